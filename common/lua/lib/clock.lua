-- lib/clock.lua: prepended to every script by common/redis_keys.load_scripts (scripts cannot import).
-- clock_ms(arg): the "now" of a script in ms. An empty argument means Redis's own TIME, so every
-- gateway uses one clock (scores, leases, quotas, deadlines); tests inject a fixed now instead.
local function clock_ms(arg)
    if arg ~= nil and arg ~= '' then
        return tonumber(arg)
    end
    redis.replicate_commands()  -- Redis 6.2 needs it before writes that follow TIME; a no-op on 7+
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

