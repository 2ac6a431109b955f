-- admit.lua: admit one job atomically: idempotency, P0 quota, wait estimate, enqueue.
-- A refusal (quota, overload, tenant cap, duplicate, id in use) writes nothing and charges nothing.
--
-- KEYS[1..4]  queue zsets of P0..P3
-- KEYS[5]     job hash of the new job
-- KEYS[6]     quota hash of the tenant (touched only when ARGV[16] > 0 and the tier is P0)
-- KEYS[7]     aging index zset
-- KEYS[8]     deadlines index zset
-- KEYS[9]     the tenant's unfinished-jobs zset (used only when ARGV[19] > 0)
-- KEYS[10]    promises index zset (used only for a P2 or P3 job given ARGV[21])
-- KEYS[11]    idempotency key (present only when the request carries one): the job id admitted under it,
--             then a space and that request's fingerprint where it was given one
-- ARGV[1]     job id
-- ARGV[2]     tenant
-- ARGV[3]     tier requested by the client (P0..P3)
-- ARGV[4]     tier to admit at before quota (P0..P3)
-- ARGV[5]     payload (opaque bytes)
-- ARGV[6]     now, ms; empty: Redis TIME
-- ARGV[7]     idempotency key TTL, ms
-- ARGV[8..11]  queue timeout of P0..P3 in ms; -1 = no timeout
-- ARGV[12..15] drain rate of P0..P3 in jobs/s (> 0, already floored by the caller)
-- ARGV[16]    quota rate, tokens/s (0 = no quota)
-- ARGV[17]    quota burst (bucket capacity, >= 1)
-- ARGV[18]    quota exhausted policy: "refuse" | "downgrade" (to P1)
-- ARGV[19]    most unfinished (queued or dispatched) jobs the tenant may hold, all tiers; 0 = no cap
-- ARGV[20]    optional: the caller's wait estimate in s (gateway/estimate.py), used instead of the one below
-- ARGV[21]    optional: ms from now at which a P2 or P3 job's promised start falls due (gateway/promises.py); "": none
-- ARGV[22]    optional: the request's fingerprint (no spaces), stored with the idempotency key; "": none
-- ARGV[23]    optional: the caller's wait estimate in s for the job as a P1, used instead of ARGV[20] when the quota
--             downgrades it (ARGV[20] is the P0 wait, which counts no P1 job); "": the estimate below
-- ARGV[24]    optional: Redis TIME in ms after which the caller no longer waits for the reply; "": none
--
-- Returns one of:
--   {"admitted", tier, estimated_wait_s, position, ahead_P0, ahead_P1, ahead_P2, ahead_P3, promise_at_ms, now_ms}
--                                                    position = queued jobs ahead of it, then per tier;
--                                                    promise_at_ms "" where none was made; now_ms: the admission
--                                                    (enqueued_at_ms), so the admission span can tell Redis's clock
--   {"duplicate", existing job id}                   the idempotency key was seen before, for this request
--   {"mismatch", existing job id}                    ... for another request (both fingerprints given, unequal)
--   {"quota", retry_after_s}                         P0 bucket empty, policy refuse
--   {"overloaded", tier, estimated_wait_s}           estimate exceeds the tier's timeout
--   {"exists"}                                       the job id is already in use
--   {"tenant_full", cap}                             the tenant holds cap unfinished jobs
--   {"withdrawn"}                                    the idempotency key was withdrawn (gateway/withdraw.py) before any
--                                                    job was admitted under it
--   {"late"}                                         run after ARGV[24] (Redis stood still meanwhile): the caller
--                                                    was told nothing was stored, so nothing is
-- (floats are returned as strings: a Lua number would be truncated to an integer.)
--
-- Estimate: sum over the tiers r at or above the job's tier of depth(r) / rate(r): each
-- backlog ahead drains at the rate its own tier is being served. Lower tiers do not count
-- (the job goes ahead of them, preempting where allowed). The job goes last in its tier.

if ARGV[24] and ARGV[24] ~= '' and clock_ms('') > tonumber(ARGV[24]) then
    return {'late'}
end

local job_id, tenant, tier_requested = ARGV[1], ARGV[2], ARGV[3]
local tier, payload = ARGV[4], ARGV[5]
local now = clock_ms(ARGV[6])
local idem_ttl_ms = tonumber(ARGV[7])
local quota_rate, quota_burst, on_exhausted = tonumber(ARGV[16]), tonumber(ARGV[17]), ARGV[18]

if #KEYS >= 11 then
    local existing = redis.call('GET', KEYS[11])
    if existing then
        local space = string.find(existing, ' ', 1, true)
        local id, fp = existing, ''
        if space then
            id, fp = string.sub(existing, 1, space - 1), string.sub(existing, space + 1)
        end
        if id == '-' then  -- withdrawn: the mark gateway/withdraw.py sets (a job id is never '-')
            return {'withdrawn'}
        end
        local asked = ARGV[22] or ''
        if fp ~= '' and asked ~= '' and fp ~= asked then
            return {'mismatch', id}
        end
        return {'duplicate', id}
    end
end
if redis.call('EXISTS', KEYS[5]) == 1 then
    return {'exists'}
end

-- Per-tenant cap. No other script keeps this count: at the cap, entries whose job has finished (or
-- whose hash has expired) are pruned here, the oldest 16 and a random 32 per attempt, so the set
-- converges on the tenant's unfinished jobs at a bounded cost per admission. The pruning is written
-- with the admission, never before a refusal: a refusal writes nothing, and the first write stays the
-- job's own (which a full Redis, maxmemory with noeviction, refuses before anything is changed).
local tenant_cap = tonumber(ARGV[19]) or 0
local gone = {}
local held = tenant_cap > 0 and redis.call('ZCARD', KEYS[9]) or 0
if tenant_cap > 0 and held >= tenant_cap then
    local job_prefix = string.sub(KEYS[5], 1, #KEYS[5] - #job_id)
    local sample = redis.call('ZRANGE', KEYS[9], 0, 15)
    for _, id in ipairs(redis.call('ZRANDMEMBER', KEYS[9], 32)) do
        sample[#sample + 1] = id
    end
    local seen = {}
    for _, id in ipairs(sample) do
        if not seen[id] then
            seen[id] = true
            local state = redis.call('HGET', job_prefix .. id, 'state')
            if state ~= 'queued' and state ~= 'dispatched' then
                gone[#gone + 1] = id
            end
        end
    end
    if held - #gone >= tenant_cap then
        return {'tenant_full', tenant_cap}
    end
end

-- P0 token bucket: compute the refilled level; write it only once the job is admitted.
local charge, tokens_left = false, 0
if tier == 'P0' and quota_rate > 0 then
    local bucket = redis.call('HMGET', KEYS[6], 'tokens', 'ts_ms')
    local tokens, ts = tonumber(bucket[1]), tonumber(bucket[2])
    if tokens == nil or ts == nil then
        tokens, ts = quota_burst, now  -- no bucket: full
    end
    tokens = math.min(quota_burst, tokens + math.max(0, now - ts) * quota_rate / 1000)
    if tokens >= 1 then
        charge, tokens_left = true, tokens - 1
    elseif on_exhausted == 'downgrade' then
        tier = 'P1'
    else
        return {'quota', tostring((1 - tokens) / quota_rate)}
    end
end

local rank = tonumber(string.sub(tier, 2))
local ahead, estimate = 0, 0
local by_tier = {0, 0, 0, 0}
for r = 0, rank do
    local depth = redis.call('ZCARD', KEYS[r + 1])
    by_tier[r + 1] = depth
    ahead = ahead + depth
    estimate = estimate + depth / tonumber(ARGV[12 + r])
end
local given = ARGV[20]
if tier ~= ARGV[4] then
    given = ARGV[23]  -- downgraded: the caller's estimate was for the tier asked, not for this one
end
if given and given ~= '' then
    estimate = tonumber(given)
end
local timeout_ms = tonumber(ARGV[8 + rank])
if timeout_ms >= 0 and estimate * 1000 > timeout_ms then
    return {'overloaded', tier, tostring(estimate)}
end

if charge then
    redis.call('HSET', KEYS[6], 'tokens', string.format('%.17g', tokens_left), 'ts_ms', now)
    -- The bucket is full again after (burst - left) / rate seconds; a missing bucket is full.
    redis.call('PEXPIRE', KEYS[6], math.ceil((quota_burst - tokens_left) / quota_rate * 1000) + 1)
end
redis.call('HSET', KEYS[5],
    'id', job_id, 'tenant', tenant, 'tier', tier, 'tier_requested', tier_requested,
    'tier_granted', tier, 'state', 'queued', 'payload', payload, 'enqueued_at_ms', now,
    'tier_since_ms', now, 'attempt', 0, 'estimate_s', tostring(estimate))
redis.call('ZADD', KEYS[rank + 1], now, job_id)
if rank >= 2 then
    redis.call('ZADD', KEYS[7], now, job_id)  -- P2 and P3 may age; P1 never ages into P0
end
if timeout_ms >= 0 then
    redis.call('HSET', KEYS[5], 'deadline_ms', now + timeout_ms)
    redis.call('ZADD', KEYS[8], now + timeout_ms, job_id)
end
local promise_at = ''
if rank >= 2 and ARGV[21] and ARGV[21] ~= '' then
    promise_at = now + math.max(0, math.floor(tonumber(ARGV[21])))
    redis.call('HSET', KEYS[5], 'promise_at_ms', promise_at)
    redis.call('ZADD', KEYS[10], promise_at, job_id)
end
if #KEYS >= 11 then
    local stored = job_id
    if ARGV[22] and ARGV[22] ~= '' then
        stored = job_id .. ' ' .. ARGV[22]
    end
    redis.call('SET', KEYS[11], stored, 'PX', idem_ttl_ms)
end
if tenant_cap > 0 then
    for _, id in ipairs(gone) do
        redis.call('ZREM', KEYS[9], id)
    end
    redis.call('ZADD', KEYS[9], now, job_id)
end
return {'admitted', tier, tostring(estimate), ahead, by_tier[1], by_tier[2], by_tier[3], by_tier[4], promise_at, now}
