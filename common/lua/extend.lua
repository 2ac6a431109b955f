-- extend.lua: move the lease expiry of a worker's dispatched jobs to now + ARGV[3].
-- Jobs dispatched to another worker (or no longer dispatched), and an attempt the worker released (release.lua),
-- are left alone.
--
-- KEYS[1]     inflight zset
-- KEYS[2..]   job hashes
-- ARGV[1]     worker id
-- ARGV[2]     now, ms; empty: Redis TIME
-- ARGV[3]     lease, ms
-- ARGV[4..]   job ids, in the order of KEYS[2..]
--
-- Returns: the number of leases extended.

local worker, expiry = ARGV[1], clock_ms(ARGV[2]) + tonumber(ARGV[3])
local extended = 0
-- Redis at maxmemory (noeviction) refuses only a script's first write that may use memory, and this script's only
-- one is a ZADD: refused, no heartbeat kept a lease while requeue.lua and claim.lua (a ZREM first) ran in full, so
-- a full Redis requeued, re-ran and at last dead-lettered the jobs of live workers. Moving existing scores uses no
-- memory: a write that cannot (no job id is empty) goes first, and lets the ZADDs through.
redis.call('ZREM', KEYS[1], '')
for i = 2, #KEYS do
    local job_id = ARGV[i + 2]
    local fields = redis.call('HMGET', KEYS[i], 'state', 'worker', 'attempt', 'released_attempt')
    if fields[1] == 'dispatched' and fields[2] == worker and fields[3] ~= fields[4]
        and redis.call('ZSCORE', KEYS[1], job_id) then
        redis.call('ZADD', KEYS[1], 'XX', expiry, job_id)
        extended = extended + 1
    end
end
return extended
