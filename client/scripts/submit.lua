-- The client's submit: an atomic check-and-add. KEYS: the idempotency marker, the lane's request stream; ARGV:
-- the entry, the lane's limit (0 = none), the result TTL, the client id (its wake stream's name), and optionally
-- the submitter's trace context (an entry field of its own, which a worker that predates it ignores). Answers
-- ADDED, DUPLICATE (nothing added) or FULL (a full backlog: nothing added, not even the marker). Workers XDEL
-- finished requests, so XLEN of the stream is the lane's backlog.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return ${SUBMIT_DUPLICATE}
end
local limit = tonumber(ARGV[2])
if limit > 0 and redis.call('XLEN', KEYS[2]) >= limit then
  return ${SUBMIT_FULL}
end
redis.call('SET', KEYS[1], 1, 'EX', ARGV[3])
local fields = {${ENTRY_FIELD}, ARGV[1]}
if ARGV[4] then
  fields[#fields + 1] = ${NOTIFY_FIELD}
  fields[#fields + 1] = ARGV[4]
end
if ARGV[5] then
  fields[#fields + 1] = ${TRACE_FIELD}
  fields[#fields + 1] = ARGV[5]
end
redis.call('XADD', KEYS[2], '*', unpack(fields))
return ${SUBMIT_ADDED}
