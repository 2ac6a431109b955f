-- append_tokens.lua: append a batch of a job's tokens to its token log (a Redis Stream), only while the job is
-- dispatched to the worker and attempt the writing gateway holds. A gateway that stood still (SIGSTOP) with a
-- worker's frames unread believes in its lease until it next reads the job's state; meanwhile the job may have
-- ended elsewhere, which deleted the log: an XADD would recreate it, a key nobody reads, for an hour.
--
-- KEYS[1]  the job's token stream
-- KEYS[2]  job hash
-- ARGV[1]  worker holding the lease, as the gateway knows it
-- ARGV[2]  its attempt
-- ARGV[3]  index of the batch's first token
-- ARGV[4]  the tokens (msgpack list)
-- ARGV[5]  MAXLEN (approximate) of the stream
-- ARGV[6]  the stream's TTL, ms
--
-- Returns 1 if appended, 0 if the job is not dispatched to that worker and attempt (nothing written).

local f = redis.call('HMGET', KEYS[2], 'state', 'worker', 'attempt')
if f[1] ~= 'dispatched' or f[2] ~= ARGV[1] or f[3] ~= ARGV[2] then
    return 0
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[5], '*', 'i', ARGV[3], 't', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 1
