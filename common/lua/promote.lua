-- promote.lua: move queued P2/P3 jobs whose promised start fell due to P1, keeping their enqueue
-- score (so they land ahead of every newer job there, and of none older), as aging's last step
-- would. Never into P0. Step two of promote(): step one read due ids from the promises index;
-- this re-verifies each (still queued in P2/P3). See gateway/promises.py for why.
--
-- KEYS[1..4]  queue zsets of P0..P3
-- KEYS[5]     aging index zset
-- KEYS[6]     promises index zset
-- KEYS[7..]   job hashes
-- ARGV[1]     now, ms (the moved jobs' tier_since and promoted_at)
-- ARGV[2..]   job ids, in the order of KEYS[7..]
--
-- Returns: flat {job id, old tier, ...} for the jobs moved.

local now = tonumber(ARGV[1])
local moved = {}
for i = 7, #KEYS do
    local job_key, job_id = KEYS[i], ARGV[i - 5]
    local f = redis.call('HMGET', job_key, 'state', 'tier', 'enqueued_at_ms')
    local rank = f[2] and tonumber(string.sub(f[2], 2))
    if f[1] == 'queued' and rank and rank >= 2 and redis.call('ZREM', KEYS[rank + 1], job_id) == 1 then
        redis.call('ZADD', KEYS[2], f[3], job_id)
        redis.call('HSET', job_key, 'tier', 'P1', 'tier_since_ms', now, 'promoted_at_ms', now)
        redis.call('ZREM', KEYS[5], job_id)  -- P1 does not age
        moved[#moved + 1] = job_id
        moved[#moved + 1] = f[2]
    end
    -- Promoted, aged into P1 already, claimed, or finished: the entry has done its work either way.
    redis.call('ZREM', KEYS[6], job_id)
end
return moved
