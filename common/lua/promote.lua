-- promote.lua: move queued P3 jobs whose promised start fell due to P2, keeping their enqueue score,
-- as if they had aged early: ahead of every P2 admitted after them, so no job admitted since goes first
-- but those that preempt (P0, and P1 where P3 work runs). From P2 they age on as any P2 does (from
-- now). Step two of promote(): step one read due ids from the promises index; this re-verifies each
-- (still queued in P3). See gateway/promises.py for why.
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
    local f = redis.call('HMGET', job_key, 'state', 'tier', 'promise_at_ms', 'enqueued_at_ms')
    if f[1] == 'queued' and f[2] == 'P3' and f[3] and redis.call('ZREM', KEYS[4], job_id) == 1 then
        redis.call('ZADD', KEYS[3], f[4], job_id)
        redis.call('HSET', job_key, 'tier', 'P2', 'tier_since_ms', now, 'promoted_at_ms', now)
        redis.call('ZADD', KEYS[5], now, job_id)  -- P2 ages on, from now
        moved[#moved + 1] = job_id
        moved[#moved + 1] = f[2]
    end
    -- Promoted, aged out of P3 already, claimed, or finished: the entry has done its work either way.
    redis.call('ZREM', KEYS[6], job_id)
end
return moved
