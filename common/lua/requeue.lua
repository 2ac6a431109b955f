-- requeue.lua: settle leases that expired. Step two of requeue_expired(): step one read
-- the expired ids from inflight; this re-verifies each (still in inflight, expiry <= now,
-- still dispatched). A job tried fewer than max_attempts times goes back to the queue of
-- its current tier with its original enqueue score (attempt kept; the next claim adds 1) and its
-- whole queue timeout from now (deadline_ms); otherwise it is dead-lettered. Attempts its workers
-- handed back (release.lua) do not count.
--
-- KEYS[1..4]  queue zsets of P0..P3
-- KEYS[5]     inflight zset
-- KEYS[6]     dead zset
-- KEYS[7]     aging index zset
-- KEYS[8]     deadlines index zset
-- KEYS[9..]   job hashes
-- ARGV[1]     now, ms
-- ARGV[2]     max attempts
-- ARGV[3]     retention of a dead job's hash, ms (as for finished jobs)
-- ARGV[4]     most entries the dead zset keeps (the oldest are dropped, with their hashes)
-- ARGV[5]     Redis TIME in ms after which the caller no longer waits for the reply; "": none
-- ARGV[6..]   job ids, in the order of KEYS[9..]
--
-- Returns: flat {job id, "queued" | "dead", worker that held it, its attempt, ...} for the jobs
-- settled (the gateway tells that worker to stop the lost attempt); "late", changing nothing, when run past
-- ARGV[5] (Redis stood still meanwhile): a lease settled unseen would leave its lost attempt running to the end
-- beside the next, for no later pass would find it in inflight to tell its worker.

if ARGV[5] ~= '' and clock_ms('') > tonumber(ARGV[5]) then
    return 'late'
end

local now, max_attempts = tonumber(ARGV[1]), tonumber(ARGV[2])
local retention_ms, dead_max = tonumber(ARGV[3]), tonumber(ARGV[4])
local settled = {}
for i = 9, #KEYS do
    local job_key, job_id = KEYS[i], ARGV[i - 3]
    local expiry = tonumber(redis.call('ZSCORE', KEYS[5], job_id))
    if expiry and expiry <= now then
        local f = redis.call('HMGET', job_key, 'state', 'attempt', 'tier', 'enqueued_at_ms',
            'tier_since_ms', 'deadline_ms', 'worker', 'releases', 'requeued_at_ms')
        redis.call('ZREM', KEYS[5], job_id)
        -- A non-dispatched job cannot hold a lease; such an entry is only dropped.
        if f[1] == 'dispatched' then
            local attempt = tonumber(f[2]) - tonumber(f[8] or 0)
            if attempt >= max_attempts then
                redis.call('HSET', job_key, 'state', 'dead', 'finished_at_ms', now,
                    'reason', 'lease expired ' .. attempt .. ' times')
                redis.call('ZADD', KEYS[6], now, job_id)
                -- Kept for the operator (payload included), but not for ever: Redis must stay bounded.
                redis.call('PEXPIRE', job_key, retention_ms)
                local over = redis.call('ZCARD', KEYS[6]) - dead_max
                if over > 0 then
                    local job_prefix = string.sub(job_key, 1, #job_key - #job_id)
                    for _, old in ipairs(redis.call('ZRANGE', KEYS[6], 0, over - 1)) do
                        if redis.call('HGET', job_prefix .. old, 'state') == 'dead' then
                            redis.call('DEL', job_prefix .. old)
                        end
                    end
                    redis.call('ZREMRANGEBYRANK', KEYS[6], 0, over - 1)
                end
                settled[#settled + 1] = job_id
                settled[#settled + 1] = 'dead'
                settled[#settled + 1] = f[7] or ''
                settled[#settled + 1] = f[2]
            else
                local rank = tonumber(string.sub(f[3], 2))
                -- requeued_at_ms and lost_worker let the next dispatch's trace show the lost attempt.
                redis.call('HSET', job_key, 'state', 'queued', 'requeued_at_ms', now,
                           'lost_worker', redis.call('HGET', job_key, 'worker') or '')
                redis.call('HDEL', job_key, 'worker', 'gateway', 'dispatched_at_ms')
                redis.call('ZADD', KEYS[rank + 1], f[4], job_id)
                if rank >= 2 then
                    redis.call('ZADD', KEYS[7], f[5], job_id)
                end
                if f[6] then
                    -- The queue timeout bounds a wait for a slot, and this job had one: it gets its whole timeout
                    -- again from now. Its admission's deadline may have passed while it ran, and expire.lua would
                    -- end a job it should resume. The timeout is the deadline less when its wait began.
                    local deadline = now + tonumber(f[6]) - tonumber(f[9] or f[4])
                    redis.call('HSET', job_key, 'deadline_ms', deadline)
                    redis.call('ZADD', KEYS[8], deadline, job_id)
                end
                settled[#settled + 1] = job_id
                settled[#settled + 1] = 'queued'
                settled[#settled + 1] = f[7] or ''
                settled[#settled + 1] = f[2]
            end
        end
    end
end
return settled
