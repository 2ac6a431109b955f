-- promote.lua: move queued P2 and P3 jobs whose promised start fell due up one tier (P3 to P2, P2 to P1),
-- keeping their enqueue score, as if they had aged early: ahead of every job of the new tier admitted after
-- them, so no job admitted since goes first but those that preempt (P0, and P1 where P3 work runs). A P3
-- ages on from P2 (from now); a P2 is then in P1, which never ages. Step two of promote(): step one read due
-- ids from the promises index; this re-verifies each (still queued in the tier it was admitted at). See
-- gateway/promises.py for why.
--
-- KEYS[1..4]  queue zsets of P0..P3
-- KEYS[5]     aging index zset
-- KEYS[6]     promises index zset
-- KEYS[7..]   job hashes
-- ARGV[1]     now, ms (the moved jobs' tier_since and promoted_at)
-- ARGV[2]     Redis TIME in ms after which the caller no longer waits for the reply; "": none
-- ARGV[3..]   job ids, in the order of KEYS[7..]
--
-- Returns: flat {job id, old tier, ...} for the jobs moved; "late", changing nothing, when run past ARGV[2] (Redis
-- stood still meanwhile): a job promoted unseen would be counted by no gateway (ts_promotions_total), for no later
-- pass would find it in the promises index.

if ARGV[2] ~= '' and clock_ms('') > tonumber(ARGV[2]) then
    return 'late'
end
local now = tonumber(ARGV[1])
local up = {P2 = {2, 'P1'}, P3 = {3, 'P2'}}  -- from a tier: the key index of the queue it moves to, its name
local moved = {}
for i = 7, #KEYS do
    local job_key, job_id = KEYS[i], ARGV[i - 4]
    local f = redis.call('HMGET', job_key, 'state', 'tier', 'promise_at_ms', 'enqueued_at_ms', 'tier_granted')
    local to = up[f[2] or '']
    -- Only from the tier it was admitted at: one aged up already has moved at least as far.
    if f[1] == 'queued' and to and f[2] == f[5] and f[3]
            and redis.call('ZREM', KEYS[to[1] + 1], job_id) == 1 then
        redis.call('ZADD', KEYS[to[1]], f[4], job_id)
        redis.call('HSET', job_key, 'tier', to[2], 'tier_since_ms', now, 'promoted_at_ms', now)
        if to[2] == 'P1' then
            redis.call('ZREM', KEYS[5], job_id)  -- P1 never ages into P0
        else
            redis.call('ZADD', KEYS[5], now, job_id)  -- P2 ages on, from now
        end
        moved[#moved + 1] = job_id
        moved[#moved + 1] = f[2]
    end
    -- Promoted, aged up already, claimed, or finished: the entry has done its work either way.
    redis.call('ZREM', KEYS[6], job_id)
end
return moved
