-- expire.lua: end queued jobs whose queue deadline (enqueue time, or the last requeue's, + timeout
-- of the tier granted at admission) has passed. Step two of expire(): step one read due ids from the
-- deadlines index; this re-verifies each (still queued, deadline <= now).
--
-- KEYS[1..4]  queue zsets of P0..P3
-- KEYS[5]     aging index zset
-- KEYS[6]     deadlines index zset
-- KEYS[7..]   job hashes
-- ARGV[1]     now, ms
-- ARGV[2]     retention of the finished job hash, ms
-- ARGV[3]     Redis TIME in ms after which the caller no longer waits for the reply; "": none
-- ARGV[4..]   job ids, in the order of KEYS[7..]
--
-- Returns: for each job expired, {id, its HGETALL as it was before, with the reason and finished_at_ms it ended
-- with} (the gateway ends its queue span with it, and its final message, which tells what a later read tells);
-- "late", changing nothing, when run past ARGV[3] (Redis stood still meanwhile): a job expired unseen would be
-- counted by no gateway, for no later pass would find it in the deadlines index.

if ARGV[3] ~= '' and clock_ms('') > tonumber(ARGV[3]) then
    return 'late'
end

local now, retention_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local expired = {}
for i = 7, #KEYS do
    local job_key, job_id = KEYS[i], ARGV[i - 3]
    local f = redis.call('HMGET', job_key, 'state', 'tier', 'tier_granted', 'deadline_ms',
        'enqueued_at_ms', 'requeued_at_ms')
    local deadline = tonumber(f[4])
    if f[1] == 'queued' and deadline and deadline <= now then
        local timeout_s = (deadline - tonumber(f[6] or f[5])) / 1000  -- a requeue restarts the wait (requeue.lua)
        local before = redis.call('HGETALL', job_key)
        redis.call('ZREM', KEYS[tonumber(string.sub(f[2], 2)) + 1], job_id)
        redis.call('ZREM', KEYS[5], job_id)
        redis.call('ZREM', KEYS[6], job_id)
        local reason = 'queue timeout of ' .. string.format('%g', timeout_s) .. 's for tier ' .. f[3] .. ' exceeded'
        redis.call('HSET', job_key, 'state', 'expired', 'finished_at_ms', now, 'reason', reason)
        redis.call('HDEL', job_key, 'payload')
        redis.call('PEXPIRE', job_key, retention_ms)
        for _, v in ipairs({'reason', reason, 'finished_at_ms', now}) do
            before[#before + 1] = v
        end
        expired[#expired + 1] = {job_id, before}
    elseif f[1] ~= 'queued' then
        redis.call('ZREM', KEYS[6], job_id)  -- not queued: the index entry is stale
    end
end
return expired
