-- One call per flush, whatever it carries: packing and parsing a command per event was most of a busy worker's
-- time. KEYS: the partition's tenant counts and running requests (`Keys.tenant_counts`, `Keys.tenant_running`),
-- then per event (PUBLISH_KEYS_PER_EVENT) its request stream (its lane's), result stream, fence hash, reply
-- stream, its client's wake stream and the usage hash of the hour (the result stream again for none). ARGV: the
-- group, the reply streams' MAXLEN, the wake streams' MAXLEN and TTL (PUBLISH_HEADER_ARGS), then per event
-- (PUBLISH_ARGS_PER_EVENT): attempt ('' = unfenced), ttl, event ('' = none: acknowledge only), seq, size, entry id
-- to acknowledge ('' = none), completion for the reply stream ('' = none; appended with the event, so exactly when
-- the event is), usage ('' = none: "<ttl s>|<tenant>|<outcome>|<estimated tokens>|<prompt tokens>|<generated
-- tokens>|<queue wait ms>|<generation ms>", a final event's, added to the tenant's counts in the usage hash with
-- the event, so a request counts once however often its final event is sent: `docs/tenants.md`; the same write
-- ends the request's running count and refunds the tokens estimated above what it used to the tenant's fair share
-- and rate).
-- Returns per event WRITTEN (written or already there), FENCED, BEHIND (the stream holds fewer tokens than the
-- event follows: a failover lost the last writes, so it is not written, which would leave a gap), or the error
-- Redis gave for that event's keys alone (pcall): one request's broken key fails that request, never the batch.
-- An error that concerns the whole server (out of memory, read-only replica, loading...) fails the call instead,
-- so the batch stays queued. Each wake stream then gets one notice naming the result streams written for its
-- client (`client._mux`).
local function count_field(tenant, what)  -- a field of `Keys.tenant_counts`
  return tenant .. '|' .. what
end

local function count_usage(hash, usage, stream, entry)
  local parts = {}
  for part in string.gmatch(usage, '[^|]+') do
    parts[#parts + 1] = part
  end
  local names = ${USAGE_COUNTS}
  if #parts ~= 4 + #names then
    return
  end
  local tenant = parts[2]
  redis.call('HINCRBY', hash, table.concat({tenant, ${USAGE_REQUESTS}, parts[3]}, '|'), 1)
  for i, name in ipairs(names) do
    redis.call('HINCRBY', hash, tenant .. '|' .. name, parts[4 + i])
  end
  redis.call('EXPIRE', hash, parts[1])
  if entry ~= '' and redis.call('ZREM', KEYS[2], tenant .. '\0' .. stream .. '\0' .. entry) == 1 then
    if redis.call('HINCRBY', KEYS[1], count_field(tenant, ${COUNT_RUNNING}), -1) <= 0 then
      redis.call('HDEL', KEYS[1], count_field(tenant, ${COUNT_RUNNING}))
    end
    local refund = tonumber(parts[4]) - tonumber(parts[5]) - tonumber(parts[6])
    if refund > 0 then
      redis.call('HINCRBY', KEYS[1], count_field(tenant, ${COUNT_REFUND}), refund)
      if redis.call('HEXISTS', KEYS[1], count_field(tenant, ${COUNT_BUCKET})) == 1 then
        redis.call('HINCRBYFLOAT', KEYS[1], count_field(tenant, ${COUNT_BUCKET}), refund)
      end
    end
  end
end

local function publish(stream, result, fence, reply, usage_hash, attempt, ttl, event, seq, size, entry, completion,
                       usage)
  local ok, write = ${PUBLISH_WRITTEN}, event ~= ''
  if attempt ~= '' then
    local current = redis.call('HMGET', fence, ${FENCE_ATTEMPT}, ${FENCE_WRITTEN})
    local held = tonumber(current[2] or '0')
    if current[1] ~= attempt then
      ok, write, entry = ${PUBLISH_FENCED}, false, ''
    elseif write and tonumber(seq) > held then
      ok, write, entry = ${PUBLISH_BEHIND}, false, ''
    else
      write = write and tonumber(seq) >= held
      if write then
        redis.call('HSET', fence, ${FENCE_WRITTEN}, tonumber(seq) + tonumber(size))
      end
      redis.call('EXPIRE', fence, ttl)
    end
  end
  if write then
    redis.call('XADD', result, '*', ${ENTRY_FIELD}, event)
    redis.call('EXPIRE', result, ttl)
    if completion ~= '' then
      redis.call('XADD', reply, 'MAXLEN', '~', ARGV[2], '*', ${ENTRY_FIELD}, completion)
    end
    if usage ~= '' then
      count_usage(usage_hash, usage, stream, entry)
    end
  end
  if entry ~= '' then
    redis.call('XACK', stream, ARGV[1], entry)
    redis.call('XDEL', stream, entry)
  end
  return ok
end
local server_wide = ${SERVER_WIDE_ERRORS}
local per_keys, per_args, header = ${PUBLISH_KEYS_PER_EVENT}, ${PUBLISH_ARGS_PER_EVENT}, ${PUBLISH_HEADER_ARGS}
local written, refused, notices = {}, {}, {}
for i = 0, (#KEYS - ${PUBLISH_HEADER_KEYS}) / per_keys - 1 do
  local k, a = ${PUBLISH_HEADER_KEYS} + per_keys * i, header + 1 + per_args * i
  local result = KEYS[k + 2]
  local outcome = refused[result]  -- a request refused once: its later events (and its ack) are not tried
  if not outcome then
    local done
    done, outcome = pcall(publish, KEYS[k + 1], result, KEYS[k + 3], KEYS[k + 4], KEYS[k + 6],
      ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 7])
    if not done then
      local message = type(outcome) == 'table' and outcome.err or tostring(outcome)
      for _, prefix in ipairs(server_wide) do
        if string.sub(message, 1, #prefix) == prefix then
          return redis.error_reply(message)
        end
      end
      outcome = message
      refused[result] = message
    end
  end
  local wake = KEYS[k + 5]
  if outcome == ${PUBLISH_WRITTEN} and wake ~= result then
    notices[wake] = notices[wake] or {}
    table.insert(notices[wake], result)
  end
  written[i + 1] = outcome
end
for wake, results in pairs(notices) do  -- a notice is a hint (the client sweeps too): a refused one is dropped
  pcall(function()
    redis.call('XADD', wake, 'MAXLEN', '~', ARGV[3], '*', ${WAKE_NOTICE}, table.concat(results, ' '))
    redis.call('EXPIRE', wake, ARGV[4])
  end)
end
return written
