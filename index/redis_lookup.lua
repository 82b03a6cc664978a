-- kvroute RedisIndex: the tier masks of a prompt's block keys, in order, up to the first
-- key nobody holds (keys are chained, so nothing after it can hit).
-- KEYS: the mask keys ns:m:<request key>, in prompt order.
local out = {}
for i, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  if not v then break end
  out[i] = v
end
return out
