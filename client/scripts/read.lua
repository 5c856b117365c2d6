-- A worker's read, lanes in order: per step (lane, wanted) an XREADGROUP of at most `wanted` new entries, while
-- `free` slots last, so a full worker takes nothing and the steps decide the lanes' shares. KEYS: the lanes'
-- request streams; ARGV: group, consumer, free, then pairs of (1-based lane index, wanted). Returns the entries
-- read as {lane index, id, fields} and, when there were none, each lane's last entry id: an XREAD BLOCK from
-- those ids wakes on the next entry without missing one added meanwhile.
local free, read = tonumber(ARGV[3]), {}
for i = 4, #ARGV - 1, 2 do
  local lane, wanted = tonumber(ARGV[i]), math.min(tonumber(ARGV[i + 1]), free)
  if wanted > 0 then
    local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', wanted, 'STREAMS', KEYS[lane], '>')
    if reply then
      for _, entry in ipairs(reply[1][2]) do
        read[#read + 1] = {lane, entry[1], entry[2]}
      end
      free = free - #reply[1][2]
    end
  end
end
local last = {}
if #read == 0 then
  for lane = 1, #KEYS do
    local newest = redis.call('XREVRANGE', KEYS[lane], '+', '-', 'COUNT', 1)
    last[lane] = newest[1] and newest[1][1] or '0-0'
  end
end
return {read, last}
