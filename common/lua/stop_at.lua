-- stop_at.lua: keep a stop with a queued or dispatched job (CancelRequest.stop_at): its answer ends with its first
-- ARGV[1] tokens, on this attempt and on every later one (a re-dispatch after its worker died or handed it back
-- carries it: DispatchJob.stop_at), so the record it ends with holds what its caller was given. A stop already kept
-- is only ever lowered: a caller's answer ended at the earliest stop it found, and tokens past it were never given
-- to anyone, so a later, larger one must not let the job run past it. A finished (or unknown) job is left alone.
--
-- KEYS[1]     job hash
-- ARGV[1]     the stop: tokens the answer holds (an integer >= 1, checked by the caller)
--
-- Returns: the job's HGETALL after the write (state, worker and attempt read in the same step as the stop was
-- kept: a claim after it carries the stop, a claim before it is the attempt the caller tells), or nil if not kept.

local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'dispatched' then
    return false
end
local n = tonumber(ARGV[1])
local kept = tonumber(redis.call('HGET', KEYS[1], 'stop_at'))
if kept == nil or n < kept then
    redis.call('HSET', KEYS[1], 'stop_at', n)
end
return redis.call('HGETALL', KEYS[1])
