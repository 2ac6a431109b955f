-- age.lua: move jobs that waited one aging interval in their tier up one tier, keeping
-- their enqueue score (so they land ahead of newer jobs there). Only P2 and P3 age: P1
-- never moves into P0. Step two of age(): step one read due ids from the aging index;
-- this re-verifies each (still queued in P2/P3, tier_since <= cutoff).
--
-- KEYS[1..4]  queue zsets of P0..P3
-- KEYS[5]     aging index zset
-- KEYS[6..]   job hashes
-- ARGV[1]     now, ms (the moved jobs' new tier_since)
-- ARGV[2]     cutoff, ms: jobs with tier_since <= cutoff are due (now - interval)
-- ARGV[3..]   job ids, in the order of KEYS[6..]
--
-- Returns: flat {job id, old tier, new tier, ...} for the jobs moved.

local now, cutoff = tonumber(ARGV[1]), tonumber(ARGV[2])
local moved = {}
for i = 6, #KEYS do
    local job_key, job_id = KEYS[i], ARGV[i - 3]
    local f = redis.call('HMGET', job_key, 'state', 'tier', 'tier_since_ms', 'enqueued_at_ms')
    local rank = f[2] and tonumber(string.sub(f[2], 2))
    if f[1] == 'queued' and rank and rank >= 2 and tonumber(f[3]) <= cutoff then
        local new_tier = 'P' .. (rank - 1)
        redis.call('ZREM', KEYS[rank + 1], job_id)
        redis.call('ZADD', KEYS[rank], f[4], job_id)
        -- aged_to_<tier> records when, so a trace can show the promotion as an event.
        redis.call('HSET', job_key, 'tier', new_tier, 'tier_since_ms', now, 'aged_to_' .. new_tier, now)
        if rank - 1 >= 2 then
            redis.call('ZADD', KEYS[5], now, job_id)
        else
            redis.call('ZREM', KEYS[5], job_id)
        end
        moved[#moved + 1] = job_id
        moved[#moved + 1] = f[2]
        moved[#moved + 1] = new_tier
    elseif f[1] ~= 'queued' or not rank or rank < 2 then
        redis.call('ZREM', KEYS[5], job_id)  -- not queued in P2/P3: the index entry is stale
    end
end
return moved
