-- first_token.lua: the gateway that observes a job's time to first token (ts_time_to_first_token_seconds) claims
-- it here first, so that a job whose first token reached two gateways (its lease lost before the token log was
-- written, then the token seen again on the next attempt; or a gateway frozen with the frames unread while
-- another took the job's stream over) is observed once. A job whose hash is gone is not recreated.
-- With the claim, when the first token came (first_token_ms, Redis ms; the earliest any gateway tells, claim won or
-- not): the gateway storing the result may have heard only a later attempt's first token (the one that heard the
-- first froze, and another ran the job on), and complete.lua stores the TTFT to the earliest. A stored result's
-- record (done, failed) is not changed: its stored TTFT was measured to the first token it keeps.
-- A claim wins only where the job's record holds a first token after it (first_token_ms, or a result's
-- ttft_s >= 0), so the count and the books agree. The claim comes with a token-log flush, up to one flush after the
-- token, and the job may have ended meanwhile (cancelled through another gateway, expired, dead-lettered): the
-- record a job ended with is final, for its final message told its readers that record's figures
-- (gateway/streaming.ended_figures). A claim on an ended job records nothing, and wins only where that record
-- holds a first token nobody claimed (a result stored with its TTFT); the gateway ending a job it holds claims its
-- pending first token with the end itself (cancel: redis_queue.cancel_recording; a result: complete_recording).
--
-- KEYS[1]  job hash
-- ARGV[1]  the claiming gateway's id
-- ARGV[2]  this claim's tag (optional; one per first token seen): a claim Redis ran after its gateway gave up on
--          the reply (Redis stood still) is asked again with the same tag, and won again. Else the retry lost to
--          the claim it repeats, and no gateway observed the first token. A gateway's id alone would not do: one
--          restarted, or sent the job again, may see a first token it observed already.
-- ARGV[3]  the first token's delay after the job's admission (enqueued_at_ms), ms (optional)
--
-- Returns 1 if this claim won it, else 0.

if redis.call('EXISTS', KEYS[1]) == 0 then
    return 0
end
local fields = redis.call('HMGET', KEYS[1], 'state', 'enqueued_at_ms', 'first_token_ms', 'ttft_s')
local state, after, enq = fields[1], tonumber(ARGV[3] or ''), tonumber(fields[2])
local first = tonumber(fields[3])
local live = state == 'queued' or state == 'dispatched'
if after and enq and live then
    local at = enq + math.max(0, math.floor(after + 0.5))
    if first == nil or at < first then
        redis.call('HSET', KEYS[1], 'first_token_ms', at)
        first = at
    end
end
-- A job still running may yet store a TTFT (the worker's, complete.lua): the claim counts its first token now.
if not live and first == nil and (tonumber(fields[4]) or -1) < 0 then
    return 0
end
local tag = ARGV[2] or ''
if redis.call('HSETNX', KEYS[1], 'ttft_observed_by', ARGV[1]) == 1 then
    if tag ~= '' then
        redis.call('HSET', KEYS[1], 'ttft_claim', tag)
    end
    return 1
end
local held = redis.call('HMGET', KEYS[1], 'ttft_observed_by', 'ttft_claim')
if tag ~= '' and held[1] == ARGV[1] and held[2] == tag then
    return 1
end
return 0
