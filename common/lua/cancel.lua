-- cancel.lua: cancel a queued or dispatched job, removing it from its queue or from
-- inflight. A job in a final state (or unknown) is left alone.
--
-- KEYS[1]     job hash
-- KEYS[2..5]  queue zsets of P0..P3
-- KEYS[6]     inflight zset
-- KEYS[7]     aging index zset
-- KEYS[8]     deadlines index zset
-- KEYS[9]     the job's token stream (deleted)
-- ARGV[1]     job id
-- ARGV[2]     now, ms; empty: Redis TIME
-- ARGV[3]     retention of the finished job hash, ms
-- ARGV[4]     reason
-- ARGV[5]     optional: Redis TIME in ms after which the caller no longer waits for the reply; "": none
--
-- Returns: the job's HGETALL as it was before cancelling, with the reason and finished_at_ms it ended with (for the
-- final message, which tells what a later read tells), or nil if not cancelled; "late", changing nothing, when
-- run past ARGV[5] (Redis stood still meanwhile: the caller was told to retry, and told the worker nothing).

if ARGV[5] and ARGV[5] ~= '' and clock_ms('') > tonumber(ARGV[5]) then
    return 'late'
end
local job_id = ARGV[1]
local now = clock_ms(ARGV[2])
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'dispatched' then
    return false
end
local before = redis.call('HGETALL', KEYS[1])
local tier = redis.call('HGET', KEYS[1], 'tier')
redis.call('ZREM', KEYS[tonumber(string.sub(tier, 2)) + 2], job_id)
redis.call('ZREM', KEYS[6], job_id)
redis.call('ZREM', KEYS[7], job_id)
redis.call('ZREM', KEYS[8], job_id)
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_at_ms', now, 'reason', ARGV[4])
redis.call('DEL', KEYS[9])
redis.call('HDEL', KEYS[1], 'payload')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
for _, v in ipairs({'reason', ARGV[4], 'finished_at_ms', now}) do
    before[#before + 1] = v
end
return before
