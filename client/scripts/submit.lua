-- The client's submit of one call's requests (one, or its `n` choices): an atomic, all-or-nothing check-and-add.
-- KEYS: the lane's request stream, then each request's idempotency marker; ARGV: the lane's limit (0 = none), the
-- result TTL, the client id (its wake stream's name), the submitter's trace context ('' = none: an entry field of
-- its own, which a worker that predates it ignores), then per request its entry and its affinity key
-- (`AFFINITY_FIELD`, '' = none: a field a worker that predates it ignores too). Answers, per request, ADDED or
-- DUPLICATE (submitted before: nothing added), or FULL for every one when the backlog has no room for the new ones
-- (nothing added, not even a marker). Added in one call, a call's requests enter the stream together, so the
-- worker that reads first takes them all and computes their shared prompt once. Workers XDEL finished requests,
-- so XLEN of the stream is the lane's backlog.
local answers, new = {}, {}
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    answers[i - 1] = ${SUBMIT_DUPLICATE}
  else
    answers[i - 1] = ${SUBMIT_ADDED}
    new[#new + 1] = i
  end
end
local limit = tonumber(ARGV[1])
if #new > 0 and limit > 0 and redis.call('XLEN', KEYS[1]) + #new > limit then
  for i = 1, #answers do
    answers[i] = ${SUBMIT_FULL}
  end
  return answers
end
for _, i in ipairs(new) do
  redis.call('SET', KEYS[i], 1, 'EX', ARGV[2])
  local fields = {${ENTRY_FIELD}, ARGV[2 * i + 1], ${NOTIFY_FIELD}, ARGV[3]}
  if ARGV[4] ~= '' then
    fields[#fields + 1] = ${TRACE_FIELD}
    fields[#fields + 1] = ARGV[4]
  end
  if ARGV[2 * i + 2] ~= '' then
    fields[#fields + 1] = ${AFFINITY_FIELD}
    fields[#fields + 1] = ARGV[2 * i + 2]
  end
  redis.call('XADD', KEYS[1], '*', unpack(fields))
end
return answers
