-- kvroute RedisIndex (layout 2): the tier bitmaps of a prompt's block keys, in order, up
-- to the first key nobody holds (keys are chained, so nothing after it can hit).
-- ARGV[1]: the mask key prefix (ns:m:); ARGV[2]: the request keys, 16 hex digits each,
-- concatenated; ARGV[3]: the namespace's meta key.
-- Returns {epoch, runs}: the namespace's epoch ('' if none) with the runs, read together,
-- so the client decodes bit positions with the names of that epoch.
-- Returns one string of runs: consecutive keys with the same bitmap are sent once, as
-- a 3-byte big-endian count, a length byte, then the bitmap.  (Holders change only where
-- some replica's cached prefix ends, so a 400-key prompt is a handful of runs; one
-- argument in and one string out keep the client's encoding and parsing cheap; one MGET
-- per 512 keys keeps the server's per-command overhead low.)
local pre, hex = ARGV[1], ARGV[2]
local n = #hex / 16
local out, m = {}, 0
local prev, count = nil, 0

local function emit()
  m = m + 1
  out[m] = string.char(math.floor(count / 65536) % 256, math.floor(count / 256) % 256,
    count % 256, #prev) .. prev
end

local i = 1
local done = false
while i <= n and not done do
  local last = math.min(i + 511, n)
  local names = {}
  for j = i, last do
    names[j - i + 1] = pre .. string.sub(hex, 16 * j - 15, 16 * j)
  end
  local vals = redis.call('MGET', unpack(names))
  for j = 1, #names do
    local v = vals[j]
    if not v then
      done = true
      break
    end
    if v == prev then
      count = count + 1
    else
      if prev then emit() end
      prev, count = v, 1
    end
  end
  i = last + 1
end
if prev then emit() end
local epoch = redis.call('HGET', ARGV[3], 'epoch') or ''
return {epoch, table.concat(out)}
