-- model_pin.lua: the cluster's one model (gateway/model_pin.py). A worker a gateway took pins its model here if
-- none is pinned, and keeps the pin alive (its hello, then its load reports): so every gateway, a restarted one
-- too, holds hellos to the model the cluster's live workers serve, not to the first one it heard itself. A worker
-- of another digest scheme (an earlier or later version), taken on its path, adds its scheme's digest.
--
-- KEYS[1]  the pin (hash: model, vocab_size, max_model_len, digest:<scheme>)
-- ARGV[1]  how long the pin outlives the last worker that kept it, ms
-- ARGV[2]  the worker's model (its path or hub name)
-- ARGV[3]  vocab_size
-- ARGV[4]  max_model_len
-- ARGV[5]  its weights digest's scheme ('' = it says none)
-- ARGV[6]  its weights digest
--
-- Returns: the pin, as HGETALL.

if redis.call('EXISTS', KEYS[1]) == 0 then
    redis.call('HSET', KEYS[1], 'model', ARGV[2], 'vocab_size', ARGV[3], 'max_model_len', ARGV[4])
end
if ARGV[5] ~= '' then
    redis.call('HSETNX', KEYS[1], 'digest:' .. ARGV[5], ARGV[6])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return redis.call('HGETALL', KEYS[1])
