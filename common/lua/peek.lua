-- peek.lua: candidate job ids in dispatch order, read-only.
--
-- KEYS[1..n]  queue zsets of the tiers to look at, most urgent first
-- ARGV[1]     the most ids to return
--
-- Returns: up to ARGV[1] job ids: all of KEYS[1] by score, then KEYS[2], ...

local want = tonumber(ARGV[1])
local ids = {}
for i = 1, #KEYS do
    if #ids >= want then
        break
    end
    local part = redis.call('ZRANGE', KEYS[i], 0, want - #ids - 1)
    for _, id in ipairs(part) do
        ids[#ids + 1] = id
    end
end
return ids
