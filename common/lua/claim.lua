-- claim.lua: hand queued jobs to a worker under a lease. A job no longer queued (claimed by
-- another gateway, cancelled, expired) is skipped, so each job is claimed exactly once.
--
-- KEYS[1..4]  queue zsets of P0..P3
-- KEYS[5]     inflight zset
-- KEYS[6]     aging index zset
-- KEYS[7]     deadlines index zset
-- KEYS[8]     promises index zset
-- KEYS[9..]   job hashes of the candidates
-- ARGV[1]     worker id
-- ARGV[2]     gateway id
-- ARGV[3]     now, ms; empty: Redis TIME
-- ARGV[4]     lease, ms
-- ARGV[5]     Redis TIME in ms after which the caller no longer waits for the reply; "": none
-- ARGV[6..]   the candidates' job ids, in the order of KEYS[9..]
--
-- Returns: one flat {field, value, ...} array (HGETALL) per claimed job, in candidate order; none when run past
-- ARGV[5] (Redis stood still meanwhile): the caller sent the worker nothing, so nothing may be leased to it.

if ARGV[5] ~= '' and clock_ms('') > tonumber(ARGV[5]) then
    return {}
end
local worker, gateway = ARGV[1], ARGV[2]
local now, lease_ms = clock_ms(ARGV[3]), tonumber(ARGV[4])
local claimed = {}
for i = 9, #KEYS do
    local job_key, job_id = KEYS[i], ARGV[i - 3]
    local fields = redis.call('HMGET', job_key, 'state', 'tier')
    if fields[1] == 'queued' then
        local queue = KEYS[tonumber(string.sub(fields[2], 2)) + 1]
        if redis.call('ZREM', queue, job_id) == 1 then
            redis.call('ZREM', KEYS[6], job_id)
            redis.call('ZREM', KEYS[7], job_id)
            redis.call('ZREM', KEYS[8], job_id)
            redis.call('HSET', job_key, 'state', 'dispatched', 'worker', worker,
                'gateway', gateway, 'dispatched_at_ms', now)
            redis.call('HINCRBY', job_key, 'attempt', 1)
            redis.call('ZADD', KEYS[5], now + lease_ms, job_id)
            claimed[#claimed + 1] = redis.call('HGETALL', job_key)
        end
    end
end
return claimed
