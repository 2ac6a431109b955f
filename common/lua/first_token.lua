-- first_token.lua: the gateway that observes a job's time to first token (ts_time_to_first_token_seconds) claims
-- it here first, so that a job whose first token reached two gateways (its lease lost before the token log was
-- written, then the token seen again on the next attempt; or a gateway frozen with the frames unread while
-- another took the job's stream over) is observed once. A job whose hash is gone is not recreated.
--
-- KEYS[1]  job hash
-- ARGV[1]  the claiming gateway's id
--
-- Returns 1 if this call claimed it, else 0.

if redis.call('EXISTS', KEYS[1]) == 0 then
    return 0
end
return redis.call('HSETNX', KEYS[1], 'ttft_observed_by', ARGV[1])
