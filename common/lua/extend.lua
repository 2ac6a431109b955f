-- extend.lua: move the lease expiry of a worker's dispatched jobs to ARGV[2].
-- Jobs dispatched to another worker (or no longer dispatched) are left alone.
--
-- KEYS[1]     inflight zset
-- KEYS[2..]   job hashes
-- ARGV[1]     worker id
-- ARGV[2]     new lease expiry, ms
-- ARGV[3..]   job ids, in the order of KEYS[2..]
--
-- Returns: the number of leases extended.

local worker, expiry = ARGV[1], tonumber(ARGV[2])
local extended = 0
for i = 2, #KEYS do
    local job_id = ARGV[i + 1]
    local fields = redis.call('HMGET', KEYS[i], 'state', 'worker')
    if fields[1] == 'dispatched' and fields[2] == worker
        and redis.call('ZSCORE', KEYS[1], job_id) then
        redis.call('ZADD', KEYS[1], 'XX', expiry, job_id)
        extended = extended + 1
    end
end
return extended
