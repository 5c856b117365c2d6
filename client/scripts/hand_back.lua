-- Hands back only entries this consumer still owns: sets their idle time past any lease, so any worker's next
-- XAUTOCLAIM takes them, and counts the hand-back in the request's fence hash (HANDED_BACK), so a request handed
-- back at every rolling restart does not run into the delivery limit; after an engine failure that implicated the
-- request it also counts that (ENGINE_FAILURES), which quarantines a request that keeps killing engines; a
-- preemption counts PREEMPTED instead of HANDED_BACK. KEYS: request stream, then one fence hash per entry; ARGV:
-- group, consumer, idle ms, the reason (`HandBackReason`), then the entry ids. Returns how many were ours.
-- The fence writes are per request (pcall): a key Redis refuses fails that count, never the other hand-backs.
local handed = 0
local reason = tonumber(ARGV[4])
for i = 5, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if entry[1] and entry[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    local fence = KEYS[i - 3]
    if redis.pcall('EXISTS', fence) == 1 then
      if reason == ${HAND_BACK_PREEMPTION} then
        redis.pcall('HINCRBY', fence, ${FENCE_PREEMPTED}, 1)
      else
        redis.pcall('HINCRBY', fence, ${FENCE_HANDED_BACK}, 1)
      end
      if reason == ${HAND_BACK_ENGINE_FAILURE} then
        redis.pcall('HINCRBY', fence, ${FENCE_ENGINE_FAILURES}, 1)
      end
    end
    handed = handed + 1
  end
end
return handed
