-- kvroute RedisIndex: the tier bitmaps of a prompt's block keys, in order, up to the
-- first key nobody holds (keys are chained, so nothing after it can hit).
-- ARGV[1]: the mask key prefix (ns:m:); ARGV[2]: the request keys, decimal, space-separated.
-- Returns one string: for each key, one length byte then that many bitmap bytes.
-- (One argument in and one string out keep the client's encoding and parsing cheap; one
-- MGET per 512 keys keeps the server's per-command overhead low.)
local pre = ARGV[1]
local names = {}
local n = 0
for k in string.gmatch(ARGV[2], '%d+') do
  n = n + 1
  names[n] = pre .. k
end
local out = {}
local m = 0
local i = 1
while i <= n do
  local last = math.min(i + 511, n)
  local vals = redis.call('MGET', unpack(names, i, last))
  for j = 1, last - i + 1 do
    local v = vals[j]
    if not v then return table.concat(out) end
    m = m + 1
    out[m] = string.char(#v) .. v
  end
  i = last + 1
end
return table.concat(out)
