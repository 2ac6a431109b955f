-- first_prefill.lua: record when a job's first prefill started (Redis ms), the end of its wait, so that the
-- gateway storing its result reports it even when another gateway heard that start (an attempt lost to a killed
-- worker, re-dispatched by another gateway). The earliest reported start stays: a gateway that stood still may
-- report an earlier attempt's start after a later one's. A job whose hash is gone is not recreated, and
-- a finished job's is not changed.
--
-- KEYS[1]  job hash
-- ARGV[1]  the start, Redis ms
--
-- Returns 1 if this call set it, else 0.

local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'dispatched' then
    return 0  -- gone, or final: a finished job's record keeps the start its stored wait was measured to
end
local old = tonumber(redis.call('HGET', KEYS[1], 'first_prefill_ms'))
if old ~= nil and old <= tonumber(ARGV[1]) then
    return 0
end
redis.call('HSET', KEYS[1], 'first_prefill_ms', ARGV[1])
return 1
