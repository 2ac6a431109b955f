-- release.lua: a worker hands back a dispatched job it will not finish (it is shutting down). Only the worker
-- holding the lease of that attempt may. The release is recorded on the job: released_attempt keeps the worker's
-- load reports, sent before the release but read after it, from extending the lease again (extend.lua), and
-- releases is subtracted from the attempts that count against max attempts (requeue.lua). The lease is made due
-- at once: the requeue that follows (the releasing gateway runs it straight away) settles it.
--
-- KEYS[1]     inflight zset
-- KEYS[2]     job hash
-- ARGV[1]     job id
-- ARGV[2]     attempt
-- ARGV[3]     worker id
--
-- Returns: 1 if released, 0 if that worker does not hold that attempt's lease (nothing changed).

local f = redis.call('HMGET', KEYS[2], 'state', 'worker', 'attempt', 'released_attempt')
if f[1] ~= 'dispatched' or f[2] ~= ARGV[3] or f[3] ~= ARGV[2] or f[4] == ARGV[2]
    or not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
    return 0
end
-- A write that uses no memory first (no job id is empty): Redis at maxmemory refuses only a script's first write
-- that may, and a hand-back refused would leave the job to wait out its lease and count the attempt, though the
-- requeue that follows (a ZREM first) runs in a full Redis.
redis.call('ZREM', KEYS[1], '')
redis.call('HSET', KEYS[2], 'released_attempt', ARGV[2])
redis.call('HINCRBY', KEYS[2], 'releases', 1)
redis.call('ZADD', KEYS[1], 'XX', 0, ARGV[1])
return 1
