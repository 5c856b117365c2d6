-- The client's submit of one call's requests (one, or its `n` choices): an atomic, all-or-nothing check-and-add.
-- KEYS: the lane's request stream, its held stream, held order, virtual times and idle hash (`Keys.fairness`), the
-- readers' mark, the tenants' limits and counts, the bound on tenants and the tenants seen (`Keys.tenants_max`,
-- `Keys.tenants_seen`), then each request's idempotency marker; ARGV: the lane's limit
-- (0 = none), the result TTL, the client id (its wake stream's name), the submitter's trace context ('' = none: an
-- entry field of its own, which a worker that predates it ignores), the tenant ('' = none), then per request its
-- entry, its affinity key (`AFFINITY_FIELD`, '' = none: a field a worker that predates it ignores too) and its
-- estimated cost in tokens. Answers, per request, ADDED or DUPLICATE (submitted before: nothing added); or FULL for
-- every one when the backlog has no room for the new ones, TENANT_FULL for every one when they would take the
-- tenant past its queued quota, TENANT_TOO_LARGE when they would pass it with nothing queued, TENANTS_FULL when
-- the tenant is new and the partition has seen its most tenants within `TENANT_SEEN_MS` (nothing added then,
-- not even a marker). Added in one call, a call's requests enter
-- the stream together, so the worker that reads first takes them all and computes their shared prompt once.
-- Workers XDEL finished requests, so XLEN of the stream and of the held stream is the lane's backlog.
--
-- Fair share (`docs/tenants.md`): while a worker that moves held requests reads the partition (the readers' mark),
-- a tenant's requests are held: added to the held stream and indexed by tenant, and the tenant, if it had nothing
-- held, joins the fair queue at the lane's virtual clock (or its own virtual time, if that is ahead: a tenant
-- cannot bank idle time). Workers move held requests to the lane's stream in fair order (`read.lua`). The tenant's
-- queued counts (requests and their estimated tokens, held in any lane) grow here and shrink as workers move them:
-- its limits ("<max queued> <max queued tokens> <max running> <tokens per minute>", 0 = none) bound them.
local stream, held, order, fair, idle, readers = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local limits, counts, bound, seen = KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local markers = 10
local function count_field(tenant, what)  -- a field of `Keys.tenant_counts`
  return tenant .. '|' .. what
end
local answers, new = {}, {}
for i = markers + 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    answers[i - markers] = ${SUBMIT_DUPLICATE}
  else
    answers[i - markers] = ${SUBMIT_ADDED}
    new[#new + 1] = i - markers
  end
end
local function all(outcome)
  for i = 1, #answers do
    answers[i] = outcome
  end
  return answers
end
local limit, tenant = tonumber(ARGV[1]), ARGV[5]
if #new > 0 and limit > 0 and redis.call('XLEN', stream) + redis.call('XLEN', held) + #new > limit then
  return all(${SUBMIT_FULL})
end
local hold = tenant ~= '' and redis.call('EXISTS', readers) == 1
if hold and #new > 0 then
  local tokens = 0
  for _, i in ipairs(new) do  -- checked before any write: a count once wrong would stay wrong
    local cost = tonumber(ARGV[3 * i + 5])
    if not cost or cost < 0 or cost > 9007199254740992 or cost ~= math.floor(cost) then
      return redis.error_reply('ERR a cost must be a whole number of tokens in [0, 2^53]')
    end
    tokens = tokens + cost
  end
  local max_queued, max_tokens = string.match(redis.call('HGET', limits, tenant) or '', '^(%d+) (%d+)')
  if max_queued then
    local queued_field, tokens_field = count_field(tenant, ${COUNT_QUEUED}), count_field(tenant, ${COUNT_QUEUED_TOKENS})
    local queued = redis.call('HMGET', counts, queued_field, tokens_field)
    max_queued, max_tokens = tonumber(max_queued), tonumber(max_tokens)
    if (max_queued > 0 and #new > max_queued) or (max_tokens > 0 and tokens > max_tokens) then
      return all(${SUBMIT_TENANT_TOO_LARGE})  -- would not fit with nothing queued: no retry helps
    end
    if (max_queued > 0 and (tonumber(queued[1]) or 0) + #new > max_queued)
        or (max_tokens > 0 and (tonumber(queued[2]) or 0) + tokens > max_tokens) then
      return all(${SUBMIT_TENANT_FULL})
    end
  end
  -- A bound on tenants: names are free to make up, and each one seen adds fields to the hashes of fair share and
  -- usage. A tenant counts until it has not submitted for `TENANT_SEEN_MS`.
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  if not redis.call('ZSCORE', seen, tenant) then
    redis.call('ZREMRANGEBYSCORE', seen, '-inf', now - ${TENANT_SEEN_MS})
    local most = tonumber(redis.call('GET', bound) or '')
    if most and redis.call('ZCARD', seen) >= most then
      return all(${SUBMIT_TENANTS_FULL})
    end
  end
  redis.call('ZADD', seen, now, tenant)
  redis.call('PEXPIRE', seen, ${TENANT_SEEN_MS})
  redis.call('HINCRBY', counts, count_field(tenant, ${COUNT_QUEUED}), #new)
  redis.call('HINCRBY', counts, count_field(tenant, ${COUNT_QUEUED_TOKENS}), tokens)
end
if hold and #new > 0 and not redis.call('ZSCORE', fair, tenant) then
  local clock = tonumber(redis.call('HGET', idle, '') or 0)
  local own = tonumber(redis.call('HGET', idle, tenant) or 0)
  redis.call('ZADD', fair, math.max(clock, own), tenant)
  redis.call('HDEL', idle, tenant)
  redis.call('HDEL', counts, count_field(tenant, ${COUNT_REFUND}))  -- no credit banked while away
end
for _, i in ipairs(new) do
  redis.call('SET', KEYS[markers + i], 1, 'EX', ARGV[2])
  local at = 3 * i + 3
  local fields = {${ENTRY_FIELD}, ARGV[at], ${NOTIFY_FIELD}, ARGV[3]}
  if ARGV[4] ~= '' then
    fields[#fields + 1] = ${TRACE_FIELD}
    fields[#fields + 1] = ARGV[4]
  end
  if ARGV[at + 1] ~= '' then
    fields[#fields + 1] = ${AFFINITY_FIELD}
    fields[#fields + 1] = ARGV[at + 1]
  end
  if tenant ~= '' then
    fields[#fields + 1] = ${TENANT_FIELD}
    fields[#fields + 1] = tenant
    fields[#fields + 1] = ${COST_FIELD}
    fields[#fields + 1] = ARGV[at + 2]
  end
  if hold then
    local id = redis.call('XADD', held, '*', unpack(fields))
    local ms, seq = string.match(id, '^(%d+)-(%d+)')
    local padded = string.rep('0', 20 - #ms) .. ms .. '-' .. string.rep('0', 20 - #seq) .. seq
    redis.call('ZADD', order, 0, tenant .. '\0' .. padded .. '\0' .. id)
  else
    redis.call('XADD', stream, '*', unpack(fields))
  end
end
return answers
