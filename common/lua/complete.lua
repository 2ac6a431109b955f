-- complete.lua: record the outcome of a dispatched job. Only the current attempt, run by
-- the worker holding the lease, may complete it: a completion from an expired (requeued or
-- re-claimed) lease, from another worker, or for a cancelled job, changes nothing. A "done"
-- needs its whole output: result fields num_tokens and token_ids (msgpack list) of that
-- length; anything else is refused with an error and changes nothing.
--
-- KEYS[1]     job hash
-- KEYS[2]     inflight zset
-- KEYS[3]     drain statistics hash
-- KEYS[4]     the job's token stream (deleted: the result is in the hash)
-- ARGV[1]     job id
-- ARGV[2]     attempt the completion belongs to
-- ARGV[3]     final state: "done" | "failed"
-- ARGV[4]     now, ms; empty: Redis TIME
-- ARGV[5]     retention of the finished job hash, ms
-- ARGV[6]     drain rate time constant tau, ms
-- ARGV[7]     worker id of the sender
-- ARGV[8]     Redis TIME in ms after which the caller no longer waits for the reply; "": none
-- ARGV[9..]   result fields: name, value, name, value, ...
--
-- A result's queued_s is the earliest recorded first start (first_prefill_ms) less the admission, if that is less;
-- its ttft_s likewise the earliest recorded first token (first_token_ms, first_token.lua), if that is less (or no
-- TTFT, -1, was given).
--
-- Returns: {1, the queued_s stored ("" if none), total ms (admission to finished_at_ms), the ttft_s stored ("" if
-- none)} if recorded: the figures a
-- later read of the result reports, for the caller's final message to its listeners and its wait estimates; 0 if
-- stale; "late", changing nothing, when run past ARGV[8] (Redis stood still
-- meanwhile): the caller keeps the result to store again, and a retry that found it stored would take it for
-- stale, so no gateway would count the job finished.
--
-- Drain statistics of the job's tier P (see common/redis_keys.py):
--   completed:P += 1;  rate:P = rate:P * exp(-(now - ts:P) / tau) + 1 / tau (jobs/s);  ts:P = now

if ARGV[8] ~= '' and clock_ms('') > tonumber(ARGV[8]) then
    return 'late'
end
local job_id, state = ARGV[1], ARGV[3]
local retention_ms, tau_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local fields = redis.call('HMGET', KEYS[1], 'state', 'attempt', 'tier', 'worker')
if fields[1] ~= 'dispatched' or fields[2] ~= ARGV[2] or fields[4] ~= ARGV[7] then
    return 0
end
if state == 'done' then
    local result = {}
    for i = 9, #ARGV - 1, 2 do
        result[ARGV[i]] = ARGV[i + 1]
    end
    local expected = tonumber(result['num_tokens'])
    local ok, tokens = pcall(cmsgpack.unpack, result['token_ids'] or '')
    if not expected or not ok or type(tokens) ~= 'table' or #tokens ~= expected then
        return redis.error_reply('incomplete result: a done job needs num_tokens and that many token_ids')
    end
end
local now = clock_ms(ARGV[4])
local tier = fields[3]
redis.call('HSET', KEYS[1], 'state', state, 'finished_at_ms', now)
if #ARGV >= 9 then
    redis.call('HSET', KEYS[1], unpack(ARGV, 9))
end
-- The wait ends at the earliest start any gateway recorded (first_prefill.lua). The caller may have measured it to
-- a later attempt's start: the gateway that heard the first stood still before writing it, and wrote it since.
local starts = redis.call('HMGET', KEYS[1], 'queued_s', 'first_prefill_ms', 'enqueued_at_ms', 'ttft_s',
                          'first_token_ms')
local given, first, enq = tonumber(starts[1]), tonumber(starts[2]), tonumber(starts[3])
local queued = starts[1] or ''
if given and first and enq and math.max(0, first - enq) / 1000 < given then
    queued = string.format('%.17g', math.max(0, first - enq) / 1000)
    redis.call('HSET', KEYS[1], 'queued_s', queued)
end
-- Likewise the first token: the storing gateway may have heard only a later attempt's (the one that heard the
-- first stood still, and another ran the job on from its token log).
local ttft_given, first_token = tonumber(starts[4]), tonumber(starts[5])
local ttft = (ttft_given and ttft_given >= 0) and starts[4] or ''
if first_token and enq and (ttft == '' or math.max(0, first_token - enq) / 1000 < ttft_given) then
    ttft = string.format('%.17g', math.max(0, first_token - enq) / 1000)
    redis.call('HSET', KEYS[1], 'ttft_s', ttft)
end
redis.call('DEL', KEYS[4])
redis.call('HDEL', KEYS[1], 'payload')
redis.call('PEXPIRE', KEYS[1], retention_ms)
redis.call('ZREM', KEYS[2], job_id)

local stats = redis.call('HMGET', KEYS[3], 'rate:' .. tier, 'ts:' .. tier)
local rate, ts = tonumber(stats[1]) or 0, tonumber(stats[2]) or now
rate = rate * math.exp(-math.max(0, now - ts) / tau_ms) + 1000 / tau_ms
redis.call('HSET', KEYS[3], 'rate:' .. tier, string.format('%.17g', rate), 'ts:' .. tier, math.max(ts, now))
redis.call('HINCRBY', KEYS[3], 'completed:' .. tier, 1)
return {1, queued, math.max(0, now - (enq or now)), ttft}
