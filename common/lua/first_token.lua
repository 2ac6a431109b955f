-- first_token.lua: the gateway that observes a job's time to first token (ts_time_to_first_token_seconds) claims
-- it here first, so that a job whose first token reached two gateways (its lease lost before the token log was
-- written, then the token seen again on the next attempt; or a gateway frozen with the frames unread while
-- another took the job's stream over) is observed once. A job whose hash is gone is not recreated.
--
-- KEYS[1]  job hash
-- ARGV[1]  the claiming gateway's id
-- ARGV[2]  this claim's tag (optional; one per first token seen): a claim Redis ran after its gateway gave up on
--          the reply (Redis stood still) is asked again with the same tag, and won again. Else the retry lost to
--          the claim it repeats, and no gateway observed the first token. A gateway's id alone would not do: one
--          restarted, or sent the job again, may see a first token it observed already.
--
-- Returns 1 if this claim won it, else 0.

if redis.call('EXISTS', KEYS[1]) == 0 then
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
