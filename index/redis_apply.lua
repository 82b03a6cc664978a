-- kvroute RedisIndex: apply one event batch's operations for one replica, atomically.
-- ARGV: ns, replica, stride, ttl_s, then ops: code, tier, n, items...
--   'a' (add): n pairs engine_key, request_key
--   'k' (add by engine key): n engine keys
--   'e' (evict): n engine keys
--   'c' (clear): n = 0
-- Keys are decimal strings; they are never converted to Lua numbers (doubles).
-- Returns the replica's bit position.
local ns, replica = ARGV[1], ARGV[2]
local stride = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local rid = redis.call('HGET', ns .. ':rid', replica)
if rid then
  rid = tonumber(rid)
else
  rid = redis.call('HINCRBY', ns .. ':meta', 'next_rid', 1) - 1
  if rid >= stride then
    return redis.error_reply('kvroute: more replicas than max_replicas=' .. stride)
  end
  redis.call('HSET', ns .. ':rid', replica, rid)
  redis.call('HSET', ns .. ':rname', rid, replica)
end
local ekey = ns .. ':e:' .. replica
local ckey = ns .. ':c:' .. replica
local rkey = ns .. ':r:' .. replica
local mpre = ns .. ':m:'

local function clear_bit(rk, tier)
  local mk = mpre .. rk
  redis.call('SETBIT', mk, tier * stride + rid, 0)
  if redis.call('BITCOUNT', mk) == 0 then redis.call('DEL', mk) end
end

local function unref(rk, tier, n)
  local f = rk .. ':' .. tier
  local q = redis.call('HINCRBY', rkey, f, -n)
  if q <= 0 then
    redis.call('HDEL', rkey, f)
    clear_bit(rk, tier)
  end
end

local function ref(ek, rk, tier)
  redis.call('HINCRBY', ckey, ek .. ':' .. tier, 1)
  redis.call('HINCRBY', rkey, rk .. ':' .. tier, 1)
  local mk = mpre .. rk
  redis.call('SETBIT', mk, tier * stride + rid, 1)
  if ttl > 0 then redis.call('EXPIRE', mk, ttl) end
end

local function drop_engine(ek, rk)
  for t = 0, 2 do
    local f = ek .. ':' .. t
    local c = redis.call('HGET', ckey, f)
    if c then
      redis.call('HDEL', ckey, f)
      unref(rk, t, tonumber(c))
    end
  end
  redis.call('HDEL', ekey, ek)
end

local function clear()
  local fields = redis.call('HKEYS', rkey)
  for _, f in ipairs(fields) do
    local sep = string.find(f, ':', 1, true)
    clear_bit(string.sub(f, 1, sep - 1), tonumber(string.sub(f, sep + 1)))
  end
  redis.call('DEL', ekey, ckey, rkey)
end

local i = 5
local nargs = #ARGV
while i <= nargs do
  local op, tier, n = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  i = i + 3
  if op == 'a' then
    for j = 0, n - 1 do
      local ek, rk = ARGV[i + 2 * j], ARGV[i + 2 * j + 1]
      local old = redis.call('HGET', ekey, ek)
      if old and old ~= rk then
        drop_engine(ek, old)
        old = false
      end
      if not old then redis.call('HSET', ekey, ek, rk) end
      ref(ek, rk, tier)
    end
    i = i + 2 * n
  elseif op == 'k' then
    for j = 0, n - 1 do
      local ek = ARGV[i + j]
      local rk = redis.call('HGET', ekey, ek)
      if rk then ref(ek, rk, tier) end
    end
    i = i + n
  elseif op == 'e' then
    for j = 0, n - 1 do
      local ek = ARGV[i + j]
      local f = ek .. ':' .. tier
      local c = tonumber(redis.call('HGET', ckey, f) or '0')
      if c > 0 then
        local rk = redis.call('HGET', ekey, ek)
        if c == 1 then
          redis.call('HDEL', ckey, f)
          if redis.call('HEXISTS', ckey, ek .. ':0') == 0
            and redis.call('HEXISTS', ckey, ek .. ':1') == 0
            and redis.call('HEXISTS', ckey, ek .. ':2') == 0 then
            redis.call('HDEL', ekey, ek)
          end
        else
          redis.call('HINCRBY', ckey, f, -1)
        end
        if rk then unref(rk, tier, 1) end
      end
    end
    i = i + n
  elseif op == 'c' then
    clear()
  else
    return redis.error_reply('kvroute: unknown op ' .. tostring(op))
  end
end
if ttl > 0 then
  redis.call('EXPIRE', ekey, ttl)
  redis.call('EXPIRE', ckey, ttl)
  redis.call('EXPIRE', rkey, ttl)
end
return rid
