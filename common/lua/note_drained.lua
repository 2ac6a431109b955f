-- note_drained.lua: a draining worker's size (its hello's tier limits), so that every gateway, a restarted one too,
-- keeps the jobs only it fits waiting for its return rather than failing them on a smaller worker
-- (gateway/drained.py). Each entry holds until when it counts: a redeploy brings the worker back within it, a
-- scale-down's is forgotten after it. Entries past it are dropped here.
--
-- KEYS[1]     drained-workers hash
-- ARGV[1]     worker id
-- ARGV[2]     its tier limits (msgpack, opaque here)
-- ARGV[3]     how long it counts, in ms
-- ARGV[4]     now in ms ('' = Redis TIME)
--
-- Returns: the ms until which it counts.

local now = clock_ms(ARGV[4])
local ttl = tonumber(ARGV[3])
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
    local until_ms = tonumber(string.match(all[i + 1], '^(%d+) '))
    if until_ms == nil or until_ms <= now then
        redis.call('HDEL', KEYS[1], all[i])
    end
end
redis.call('HSET', KEYS[1], ARGV[1], (now + ttl) .. ' ' .. ARGV[2])
-- The hash outlives none of its entries by more than a TTL: a cluster that stops draining leaves nothing behind.
redis.call('PEXPIRE', KEYS[1], ttl)
return now + ttl
