-- kvroute RedisIndex (layout 2): apply one event batch's operations for one replica,
-- atomically.
-- ARGV: ns, replica, stride, ttl_s, epoch, then ops, each: code, tier, n, payload...
--   'a' (add): two payload args, n engine keys then n request keys
--   'k' (add by engine key): one payload arg, n engine keys
--   'e' (evict): one payload arg, n engine keys
--   'c' (clear): n = 0, no payload
-- A payload is its keys as 16 hex digits each, concatenated: keys are never converted to
-- Lua numbers (doubles), and one argument per op keeps the client's encoding cheap.
-- Returns the replica's bit position.  Refuses to write (error 'kvroute:reset') unless
-- the namespace's epoch is the client's: after Redis restarted empty or was flushed, bit
-- positions are handed out anew and the client must learn them first.
local ns, replica = ARGV[1], ARGV[2]
local stride = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
if redis.call('HGET', ns .. ':meta', 'epoch') ~= ARGV[5] then
  return redis.error_reply('kvroute:reset the namespace is not epoch ' .. ARGV[5])
end
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
local rkey = ns .. ':r:' .. replica
local mpre = ns .. ':m:'
local FRESH = {' 1 0 0', ' 0 1 0', ' 0 0 1'}
local TIER = {'0', '1', '2'}
local call = redis.call

-- e:<replica> values: '<request key> <gpu> <cpu> <storage>' (reference counts).
local function parse(v)
  local rk, g, c, s = string.match(v, '^(%x+) (%d+) (%d+) (%d+)$')
  return rk, {tonumber(g), tonumber(c), tonumber(s)}
end

local function store(ek, rk, cnt)
  if cnt[1] + cnt[2] + cnt[3] == 0 then
    redis.call('HDEL', ekey, ek)
  else
    redis.call('HSET', ekey, ek, rk .. ' ' .. cnt[1] .. ' ' .. cnt[2] .. ' ' .. cnt[3])
  end
end

-- r:<replica> fields '<request key><tier>': how many engine keys hold it in that tier.
-- The bitmap bit is set while the count is positive.
local function ref(rk, tier)
  if call('HINCRBY', rkey, rk .. TIER[tier + 1], 1) == 1 then
    local mk = mpre .. rk
    call('SETBIT', mk, tier * stride + rid, 1)
    if ttl > 0 then call('EXPIRE', mk, ttl) end
  end
end

local function clear_bit(rk, tier)
  local mk = mpre .. rk
  redis.call('SETBIT', mk, tier * stride + rid, 0)
  if redis.call('BITCOUNT', mk) == 0 then redis.call('DEL', mk) end
end

local function unref(rk, tier, n)
  local f = rk .. TIER[tier + 1]
  if redis.call('HINCRBY', rkey, f, -n) <= 0 then
    redis.call('HDEL', rkey, f)
    clear_bit(rk, tier)
  end
end

local function add(ek, rk, tier)
  if call('HSETNX', ekey, ek, rk .. FRESH[tier + 1]) == 0 then
    local old, cnt = parse(redis.call('HGET', ekey, ek))
    if old ~= rk then
      -- The engine reused a hash for other content (a collision, or a restart nobody
      -- told us about): forget the old mapping entirely.
      for t = 0, 2 do
        if cnt[t + 1] > 0 then unref(old, t, cnt[t + 1]) end
      end
      cnt = {0, 0, 0}
    end
    cnt[tier + 1] = cnt[tier + 1] + 1
    store(ek, rk, cnt)
  end
  ref(rk, tier)
end

local function add_known(ek, tier)
  local v = redis.call('HGET', ekey, ek)
  if v then
    local rk, cnt = parse(v)
    cnt[tier + 1] = cnt[tier + 1] + 1
    store(ek, rk, cnt)
    ref(rk, tier)
  end
end

local function evict(ek, tier)
  local v = redis.call('HGET', ekey, ek)
  if v then
    local rk, cnt = parse(v)
    if cnt[tier + 1] > 0 then
      cnt[tier + 1] = cnt[tier + 1] - 1
      store(ek, rk, cnt)
      unref(rk, tier, 1)
    end
  end
end

local function clear()
  for _, f in ipairs(redis.call('HKEYS', rkey)) do
    clear_bit(string.sub(f, 1, 16), tonumber(string.sub(f, 17)))
  end
  redis.call('DEL', ekey, rkey)
end

local i = 6
local nargs = #ARGV
while i <= nargs do
  local op, tier, n = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  i = i + 3
  if op == 'a' then
    local eks, rks = ARGV[i], ARGV[i + 1]
    local sub = string.sub
    for p = 1, 16 * n, 16 do
      add(sub(eks, p, p + 15), sub(rks, p, p + 15), tier)
    end
    i = i + 2
  elseif op == 'k' or op == 'e' then
    local eks = ARGV[i]
    local f = (op == 'k') and add_known or evict
    local sub = string.sub
    for p = 1, 16 * n, 16 do
      f(sub(eks, p, p + 15), tier)
    end
    i = i + 1
  elseif op == 'c' then
    clear()
  else
    return redis.error_reply('kvroute: unknown op ' .. tostring(op))
  end
end
if ttl > 0 then
  redis.call('EXPIRE', ekey, ttl)
  redis.call('EXPIRE', rkey, ttl)
end
return rid
