-- Lease renewal: resets the idle time of the entries this consumer still owns. KEYS: the request stream; ARGV:
-- group, consumer, then the entry ids. Returns the ids it no longer owns (claimed by another, or acknowledged).
local lost = {}
for i = 3, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if entry[1] and entry[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
