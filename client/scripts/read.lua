-- A worker's read, lanes in order: per step (lane, wanted, routed) at most `wanted` entries, while `free` slots last,
-- so a full worker takes nothing and the steps decide the lanes' shares.
--
-- Cache affinity (`docs/workers.md`), on the lanes a step marks routed: each affinity key (`AFFINITY_FIELD`) has a
-- holder among the live workers (those that reported lately; see `owner_of`). An entry whose key another worker
-- holds is not taken but assigned to it when that worker has a free slot, or fewer than `queue` entries waiting
-- for it: moved to its pending list (XCLAIM JUSTID, so no delivery is counted), noted in the `assigned` set and
-- announced on the `wake` stream. A worker takes what was assigned to it before new entries; a routing worker that
-- finds nothing new to read takes an assignment older than its `wait` ms (its worker is slow, full or dead). An
-- entry whose holder has a full queue is taken by whoever read it: affinity never leaves a slot empty for longer
-- than the wait while requests wait. A worker with routing off (wait 0) reports nothing and takes no assignment:
-- it reads as if affinity did not exist. A call that says so reports this worker's free slots left, with the time,
-- in the `workers` hash.
--
-- KEYS: the lanes' request streams, then the `assigned` sorted set (score: when; member: "lane id deliveries
-- worker"), the `workers` hash (worker -> "free ms"), the `wake` stream, the `holders` hash (key -> worker), the
-- `used` sorted set (key by last use) and the `loads` hash (worker -> keys held). ARGV: group, consumer, free, wait
-- ms (0: route nothing), live ms (how recent a report makes a worker live), hold ms (how long an unused key keeps
-- its holder), queue (entries that may wait for a full holder), 1 to report the free slots left (0: `free` is not
-- this worker's room, say a full worker's look for one interactive request), the number of lanes, their names,
-- then quadruples of (1-based lane index, wanted, 1 if routed, kept: how many of the free slots only a tenant with
-- nothing running may take on this lane; see `promote`). Returns the entries read as {lane index, id,
-- fields}; when there were none, each lane's last entry id and the wake stream's (an XREAD BLOCK from those ids
-- wakes on the next entry or assignment without missing one added meanwhile) and the ms until another worker's
-- assignment may be taken (-1: none); and the counts {assigned to others, taken of this worker's, taken of
-- others', read here past a full holder's queue}.
local group, me, free = ARGV[1], ARGV[2], tonumber(ARGV[3])
local wait, live, hold, queue = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local report, lanes = tonumber(ARGV[8]) == 1, tonumber(ARGV[9])
local assigned, workers, wake = KEYS[lanes + 1], KEYS[lanes + 2], KEYS[lanes + 3]
local holders, used, loads = KEYS[lanes + 4], KEYS[lanes + 5], KEYS[lanes + 6]
local weights, readers = KEYS[lanes + 6 + 4 * lanes + 1], KEYS[lanes + 6 + 4 * lanes + 2]
local names = {}
for i = 1, lanes do
  names[i] = ARGV[9 + i]
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local read, counts = {}, {0, 0, 0, 0}

-- The live workers, each with its free slots and when it reported them.
local owners, room, seen = {}, {}, {}
if wait > 0 then
  -- HKEYS and HMGET rather than HGETALL, which clients call too: `bench.capacity` tells scripts' commands apart.
  local names_of = redis.call('HKEYS', workers)
  local reports = #names_of > 0 and redis.call('HMGET', workers, unpack(names_of)) or {}
  for i, worker in ipairs(names_of) do
    local slots, at = string.match(reports[i] or '', '^(%-?%d+) (%d+)')
    local age = at and now - tonumber(at) or math.huge
    if age <= live then
      owners[#owners + 1] = worker
      room[worker], seen[worker] = tonumber(slots), at
    elseif age > 10 * live then
      redis.call('HDEL', workers, worker)
    end
  end
  if room[me] == nil then
    owners[#owners + 1] = me
  end
end

-- The keys' holders: a key's entries go to the worker that holds it while that worker is live and holds no
-- more than one key above the least loaded live worker; else (a new key, a dead holder, an uneven fleet, say one
-- just joined) to the live worker holding the fewest keys, ties broken by rendezvous hashing, and that worker
-- holds it from then on. A full new holder is not given the entry (it has nothing of it cached to wait for): the
-- reader runs it, and holds the key instead when that keeps the keys as even. A key unused for `hold` ms is
-- forgotten, and so is the least recently used one when a new key would pass `AFFINITY_MAX_KEYS`: traffic whose
-- every prompt is new keeps the hashes bounded.
local load = {}

local function unload(holder)  -- one key fewer held by `holder`
  redis.call('HINCRBY', loads, holder, -1)
  if load[holder] ~= nil then
    load[holder] = load[holder] - 1
  end
end

local function forget(key)
  local holder = redis.call('HGET', holders, key)
  if holder then
    unload(holder)
  end
  redis.call('HDEL', holders, key)
  redis.call('ZREM', used, key)
end

if wait > 0 then
  for _, key in ipairs(redis.call('ZRANGEBYSCORE', used, '-inf', now - hold, 'LIMIT', 0, 32)) do
    forget(key)
  end
  local counts = redis.call('HMGET', loads, unpack(owners))
  for i, worker in ipairs(owners) do
    load[worker] = math.max(tonumber(counts[i]) or 0, 0)
  end
end

local function least_loaded(key)
  local best, fewest, top = me, nil, nil
  for _, worker in ipairs(owners) do
    local score = redis.sha1hex(worker .. '\n' .. key)
    if fewest == nil or load[worker] < fewest or (load[worker] == fewest and score > top) then
      best, fewest, top = worker, load[worker], score
    end
  end
  return best, fewest
end

-- Makes `worker` the key's holder in place of `previous` (nil: it had none).
local function hold_at(key, previous, worker)
  if previous then
    unload(previous)
  end
  redis.call('HSET', holders, key, worker)
  redis.call('HINCRBY', loads, worker, 1)
  redis.call('PEXPIRE', holders, 2 * hold)
  redis.call('PEXPIRE', loads, 2 * hold)
  load[worker] = load[worker] + 1
end

-- The key's holder, and whether it held the key before this call (so may have its prefix cached).
local function owner_of(key)
  local holder = redis.call('HGET', holders, key)
  if not holder and redis.call('ZCARD', used) >= ${AFFINITY_MAX_KEYS} then
    forget(redis.call('ZRANGE', used, 0, 0)[1])
  end
  local least, fewest = least_loaded(key)
  redis.call('ZADD', used, now, key)
  redis.call('PEXPIRE', used, 2 * hold)
  if holder and load[holder] ~= nil and load[holder] - fewest < 2 then
    return holder, true
  end
  hold_at(key, holder, least)
  return least, false
end

local function field(fields, name)
  for i = 1, #fields - 1, 2 do
    if fields[i] == name then
      return fields[i + 1]
    end
  end
  return nil
end

-- Quotas (`Keys.tenant_limits`: "<max queued> <max queued tokens> <max running> <tokens per minute>", 0 = none),
-- read once per call and tenant.
local quota_keys = lanes + 6 + 4 * lanes + 2
local limits, tallies, running = KEYS[quota_keys + 1], KEYS[quota_keys + 2], KEYS[quota_keys + 3]
local quotas, limited = {}, redis.call('EXISTS', limits) == 1

local function count_field(tenant, what)  -- a field of `Keys.tenant_counts`
  return tenant .. '|' .. what
end

local function quota(tenant, packed)  -- `packed`: its limits, when read already
  if quotas[tenant] == nil then
    packed = packed or redis.call('HGET', limits, tenant) or ''
    local _, _, max_running, rate = string.match(packed, '^(%d+) (%d+) (%d+) (%d+)')
    quotas[tenant] = {tonumber(max_running) or 0, tonumber(rate) or 0}
  end
  return quotas[tenant][1], quotas[tenant][2]
end

-- The tokens left of a tenant's rate: a bucket of a minute's tokens, full when never used, refilled as time passes.
local function bucket(tenant, rate)
  local bucket_field, at_field = count_field(tenant, ${COUNT_BUCKET}), count_field(tenant, ${COUNT_BUCKET_MS})
  local level = redis.call('HMGET', tallies, bucket_field, at_field)
  if not level[1] or not level[2] then
    return rate
  end
  return math.min(rate, tonumber(level[1]) + (now - tonumber(level[2])) * rate / 60000)
end

local function add(tenant, what, delta)
  if redis.call('HINCRBY', tallies, count_field(tenant, what), delta) <= 0 then
    redis.call('HDEL', tallies, count_field(tenant, what))
  end
end

-- A running count lapses with its request's lease on the count (`TENANT_RUNNING_TTL_MS`): a request lost without
-- its final event, which frees it at once (`publish.lua`), cannot hold its tenant's quota for good.
for _, member in ipairs(redis.call('ZRANGEBYSCORE', running, '-inf', now, 'LIMIT', 0, 32)) do
  redis.call('ZREM', running, member)
  add(string.match(member, '^[^%z]*'), ${COUNT_RUNNING}, -1)
end

-- The tenants with a rate (the only ones that may be reserved), with every tenant's quotas, read once per call:
-- an operator sets them, so they are few beside the tenants that submit.
local rated
local function rated_tenants()
  if rated == nil then
    rated = {}
    local names_of = redis.call('HKEYS', limits)
    for first = 1, #names_of, 512 do  -- HMGET a slice at a time: Lua unpacks a few thousand values at most
      local last = math.min(first + 511, #names_of)
      local packed = redis.call('HMGET', limits, unpack(names_of, first, last))
      for i = first, last do
        quotas[names_of[i]] = nil
        if select(2, quota(names_of[i], packed[i - first + 1])) > 0 then
          rated[#rated + 1] = names_of[i]
        end
      end
    end
  end
  return rated
end

-- Whether a tenant may have a request moved now (not at its running quota; for a kept slot, nothing running), and
-- its rate.
local function may_run(tenant, idle_only)
  local max_running, rate = quota(tenant)
  if max_running == 0 and not idle_only then
    return true, rate
  end
  local busy = tonumber(redis.call('HGET', tallies, count_field(tenant, ${COUNT_RUNNING}))) or 0
  return (busy == 0 or not idle_only) and (max_running == 0 or busy < max_running), rate
end

-- The tenant whose oldest held entry runs next, its virtual time, and whether it was chosen by virtual time (not
-- for its reserved rate, nor as overflow, nor for a kept slot: the lane's clock follows only those). Without quotas,
-- the least virtual time. With them, a tenant at its running quota waits; one within its rate (reserved capacity)
-- goes first, the least virtual time of those; then tenants without a rate; then those past their rate (overflow:
-- only while no one else waits). For a kept slot (`idle_only`), only a tenant with nothing running may be chosen.
-- In fair order the look stops at the first tenant that may run without a rate: the tenants passed over before it
-- each have a request running or a rate, so it looks at no more than the running requests and the rated tenants,
-- however many tenants wait.
local function pick(fair, idle_only)
  if not limited and not idle_only then
    local first = redis.call('ZRANGE', fair, 0, 0, 'WITHSCORES')
    return first[1], tonumber(first[2]), true
  end
  if limited then
    local best, best_time
    for _, tenant in ipairs(rated_tenants()) do
      local vtime = tonumber(redis.call('ZSCORE', fair, tenant))
      if vtime and (best_time == nil or vtime < best_time) then
        local ok, rate = may_run(tenant, idle_only)
        if ok and bucket(tenant, rate) >= 1 then
          best, best_time = tenant, vtime
        end
      end
    end
    if best then
      return best, best_time, false
    end
  end
  local overflow, overflow_time
  local most = redis.call('ZCARD', running) + (limited and #rated_tenants() or 0) + 1
  local slice = 64  -- tenants read per ZRANGE: most looks end in the first
  for first = 0, most - 1, slice do
    local tenants = redis.call('ZRANGE', fair, first, math.min(first + slice - 1, most - 1), 'WITHSCORES')
    for i = 1, #tenants, 2 do
      local ok, rate = may_run(tenants[i], idle_only)
      if ok and rate == 0 then
        return tenants[i], tonumber(tenants[i + 1]), not idle_only
      elseif ok and overflow == nil then  -- past its rate, or it would have been reserved above
        overflow, overflow_time = tenants[i], tonumber(tenants[i + 1])
      end
    end
    if #tenants < 2 * slice then  -- tenant, score pairs: fewer than asked, the fair set has no more
      break
    end
  end
  if overflow then
    return overflow, overflow_time, false
  end
  return nil, nil, false
end

local stays = {}  -- entries moved for quiet tenants, read here (see `promote`)

-- Whether the lane's stream holds entries no worker has read (its group has not delivered its newest): a move
-- goes behind them, so the next read would take one of them instead (entries without a tenant, from clients of
-- the last release, or added while no worker read the partition).
local function unread(lane)
  local newest = redis.call('XREVRANGE', KEYS[lane], '+', '-', 'COUNT', 1)[1]
  if not newest then
    return false
  end
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', KEYS[lane])) do
    local name, delivered
    for j = 1, #info - 1, 2 do
      if info[j] == 'name' then
        name = info[j + 1]
      elseif info[j] == 'last-delivered-id' then
        delivered = info[j + 1]
      end
    end
    if name == group then  -- the newest entry came after the last one delivered (which may be deleted since)
      local ms, seq = string.match(newest[1], '^(%d+)-(%d+)')
      local delivered_ms, delivered_seq = string.match(delivered, '^(%d+)-(%d+)')
      ms, delivered_ms = tonumber(ms), tonumber(delivered_ms)
      return ms > delivered_ms or (ms == delivered_ms and tonumber(seq) > tonumber(delivered_seq))
    end
  end
  return true
end


-- Fair share between tenants: moves up to `count` held entries of `lane` to its stream, each time the oldest of
-- the tenant `pick` chooses, whose virtual time then grows by the entry's cost (`COST_FIELD`, less what its finished
-- requests did not use: their refund) over the tenant's weight; the lane's clock is the virtual time of the latest
-- move in fair order (a tenant that starts holding again starts there). Each move updates the tenant's quota state: queued down,
-- running up (until the request's final event), its rate's bucket down by the cost. `room` is this worker's free
-- slots: the last `keep` of them go only to tenants with nothing running (so a quiet tenant's request starts at once
-- while another floods the fleet). With slots kept, every entry moved for a tenant that had nothing running is noted
-- in `stays` (read here, never assigned away: a worker whose open slots are full would leave it waiting for one,
-- though a kept slot is free here). Returns how many moved.
local function promote(lane, count, room, keep)
  local base = lanes + 6 + 4 * (lane - 1)
  local held, order, fair, idle = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]
  local moved, behind = 0, keep > 0 and unread(lane)  -- before this call's moves, which the caller reads next
  while moved < count do
    local idle_only = room - moved <= keep
    if idle_only and behind then
      break  -- a kept slot is for a quiet tenant's request, never for what waits unread on the stream
    end
    local tenant, vtime, in_order = pick(fair, idle_only)
    if not tenant then
      break
    end
    local head = redis.call('ZRANGEBYLEX', order, '[' .. tenant .. '\0', '(' .. tenant .. '\1', 'LIMIT', 0, 2)
    if head[1] then
      redis.call('ZREM', order, head[1])
      local id = string.match(head[1], '%z[^%z]*%z(.+)')
      local entry = redis.call('XRANGE', held, id, id)[1]
      if entry then
        local moved_id = redis.call('XADD', KEYS[lane], '*', unpack(entry[2]))
        redis.call('XDEL', held, id)
        if keep > 0 and (idle_only or not redis.call('HGET', tallies, count_field(tenant, ${COUNT_RUNNING}))) then
          stays[moved_id] = true
        end
        local weight = tonumber(redis.call('HGET', weights, tenant)) or 1
        local estimate = tonumber(field(entry[2], ${COST_FIELD})) or 0  -- as `submit.lua` counted it
        local cost = math.max(estimate, 1)
        local owed = tonumber(redis.call('HGET', tallies, count_field(tenant, ${COUNT_REFUND}))) or 0
        local refund = math.min(owed, cost - 1)
        if refund > 0 then
          add(tenant, ${COUNT_REFUND}, -refund)
        end
        if in_order then  -- a reserved move ahead of its turn must not push the clock past those waiting theirs
          redis.call('HSET', idle, '', vtime)
        end
        vtime = vtime + (cost - refund) / (weight > 0 and weight or 1)
        add(tenant, ${COUNT_QUEUED}, -1)
        add(tenant, ${COUNT_QUEUED_TOKENS}, -estimate)
        -- "tenant\0stream\0id": ids are unique per stream only, and two lanes may give the same one
        redis.call('ZADD', running, now + ${TENANT_RUNNING_TTL_MS}, tenant .. '\0' .. KEYS[lane] .. '\0' .. moved_id)
        add(tenant, ${COUNT_RUNNING}, 1)
        local _, rate = quota(tenant)
        if rate > 0 then
          local left = bucket(tenant, rate) - cost
          redis.call('HSET', tallies, count_field(tenant, ${COUNT_BUCKET}), left)
          redis.call('HSET', tallies, count_field(tenant, ${COUNT_BUCKET_MS}), now)
        end
        moved = moved + 1
      end
    end
    if head[2] then
      redis.call('ZADD', fair, vtime, tenant)
    else
      redis.call('ZREM', fair, tenant)
      redis.call('HSET', idle, tenant, vtime)
    end
    redis.call('PEXPIRE', idle, ${FAIR_IDLE_TTL_MS})
  end
  return moved
end

-- Entries waiting for each worker: assignments not taken yet.
local queued = {}
if wait > 0 then
  local members = redis.call('ZRANGE', assigned, 0, -1)
  for _, member in ipairs(members) do
    local _, _, _, worker = string.match(member, '^(%S+) (%S+) (%d+) (%S+)')
    if worker then
      queued[worker] = (queued[worker] or 0) + 1
    end
  end
end

-- Takes up to `wanted` assignments of lane `lane` that `wanted_here` accepts (given the worker assigned and the
-- assignment's age). An assignment is taken only while its entry is still pending to its worker with the
-- deliveries it had (else a lease claim moved it on).
local function take_assigned(lane, wanted, wanted_here)
  local got = 0
  local members = redis.call('ZRANGE', assigned, 0, -1, 'WITHSCORES')
  for i = 1, #members, 2 do
    if got >= wanted then
      break
    end
    local name, id, deliveries, worker = string.match(members[i], '^(%S+) (%S+) (%d+) (%S+)')
    local mine = worker == me
    if name == nil then
      redis.call('ZREM', assigned, members[i])
    elseif name == names[lane] and wanted_here(worker, now - tonumber(members[i + 1])) then
      redis.call('ZREM', assigned, members[i])
      local pending = redis.call('XPENDING', KEYS[lane], group, id, id, 1)
      if pending[1] and pending[1][2] == worker and tonumber(pending[1][4]) == tonumber(deliveries) then
        redis.call('XCLAIM', KEYS[lane], group, me, 0, id, 'JUSTID')
        local entry = redis.call('XRANGE', KEYS[lane], id, id)
        if entry[1] then
          read[#read + 1] = {lane, id, entry[1][2]}
          got = got + 1
          if mine then
            counts[2] = counts[2] + 1
          else
            counts[3] = counts[3] + 1
          end
        end
      end
    end
  end
  return got
end

-- Before anything new: what was assigned to this worker, and what waited the wait for a worker gone silent. An
-- entry waiting for a live worker stays its own: that worker's queue is bounded (`queue`), and taking it here
-- under a backlog, where every entry waits, would give up its cached prefix for nothing.
local function mine_or_orphaned(worker, age)
  return worker == me or (age >= wait and room[worker] == nil)
end

-- Rather than an empty slot: what waited the wait for another worker.
local function past_the_wait(worker, age)
  return worker ~= me and age >= wait
end

-- Assigns a new entry to its key's holder when that is another live worker with a free slot, or a full one with
-- fewer than `queue` entries waiting for it (it takes them before anything new as slots free); false: take it here.
local function assign(lane, id, fields)
  local key = field(fields, ${AFFINITY_FIELD})
  if key == nil then
    return false
  end
  local owner, cached = owner_of(key)
  if owner == me then
    return false
  end
  if not cached and (room[owner] or 0) <= 0 then
    -- Its new holder is full and has nothing of it cached: waiting there for a slot would gain nothing, and would
    -- let the tenant's later requests start first. It runs here, which also holds it from now on if that keeps
    -- the keys as even (this worker holds no more than the new holder did).
    if load[me] < load[owner] then
      hold_at(key, owner, me)
    end
    return false
  end
  if (room[owner] or 0) > 0 then
    room[owner] = room[owner] - 1
    redis.call('HSET', workers, owner, room[owner] .. ' ' .. seen[owner])
  elseif room[owner] == nil then
    return false
  elseif (queued[owner] or 0) >= queue then
    counts[4] = counts[4] + 1
    return false
  end
  queued[owner] = (queued[owner] or 0) + 1
  redis.call('XCLAIM', KEYS[lane], group, owner, 0, id, 'JUSTID')
  redis.call('ZADD', assigned, now, names[lane] .. ' ' .. id .. ' ' .. 1 .. ' ' .. owner)
  redis.call('PEXPIRE', assigned, 10 * live)
  redis.call('XADD', wake, 'MAXLEN', '~', 100, '*', ${AFFINITY_NOTICE}, owner)
  redis.call('PEXPIRE', wake, 10 * live)
  counts[1] = counts[1] + 1
  return true
end

local most_kept = 0
for i = 10 + lanes, #ARGV - 3, 4 do
  local lane, routed, keep = tonumber(ARGV[i]), tonumber(ARGV[i + 2]) == 1, tonumber(ARGV[i + 3])
  local wanted = math.min(tonumber(ARGV[i + 1]), free)
  most_kept = math.max(most_kept, keep)
  local function open()  -- the slots any entry may take: not the kept ones
    return math.min(wanted, math.max(free - keep, 0))
  end
  if wanted > 0 and routed and wait > 0 then
    local got = take_assigned(lane, open(), mine_or_orphaned)
    wanted, free = wanted - got, free - got
  end
  -- Entries assigned away leave their slots free: read again, a bounded number of times (each assignment uses a
  -- free slot another worker reported, or a place in a full one's queue, so they run out).
  local rounds = 0
  while wanted > 0 and rounds < 8 do
    rounds = rounds + 1
    local asked, entries = wanted, {}
    if open() > 0 then
      local reply = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', open(), 'STREAMS', KEYS[lane], '>')
      entries = reply and reply[1][2] or {}
    end
    -- Held entries move to the stream only as it runs dry, so the fair order decides what runs next.
    local promoted = #entries < asked and promote(lane, asked - #entries, free - #entries, keep) or 0
    if promoted > 0 then
      local more = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', promoted, 'STREAMS', KEYS[lane], '>')
      for _, entry in ipairs(more and more[1][2] or {}) do
        entries[#entries + 1] = entry
      end
    end
    if #entries == 0 then
      break
    end
    for _, entry in ipairs(entries) do
      if not (routed and wait > 0 and not stays[entry[1]] and assign(lane, entry[1], entry[2])) then
        read[#read + 1] = {lane, entry[1], entry[2]}
        wanted, free = wanted - 1, free - 1
      end
    end
    if #entries < asked then
      break
    end
  end
  -- Nothing more to read: entries another worker left past the wait, rather than an empty slot.
  if wanted > 0 and routed and wait > 0 then
    local got = take_assigned(lane, open(), past_the_wait)
    wanted, free = wanted - got, free - got
  end
end

if wait > 0 and report then
  redis.call('HSET', workers, me, math.max(free - most_kept, 0) .. ' ' .. now)
  redis.call('PEXPIRE', workers, 10 * live)
end
redis.call('SET', readers, 1, 'PX', 10 * live)  -- clients hold tenants' requests while a worker moves them

local last, retry = {}, -1
if #read == 0 then
  for i = 1, 2 * lanes + 1 do
    local stream = i <= lanes and KEYS[i] or (i == lanes + 1 and wake or KEYS[lanes + 6 + 4 * (i - lanes - 2) + 1])
    local newest = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
    last[i] = newest[1] and newest[1][1] or '0-0'
  end
  local members = redis.call('ZRANGE', assigned, 0, -1, 'WITHSCORES')
  for i = 1, #members, 2 do
    local due = tonumber(members[i + 1]) + wait - now
    if due > 0 and string.sub(members[i], -#me - 1) ~= ' ' .. me and (retry < 0 or due < retry) then
      retry = due
    end
  end
end
return {read, last, retry, counts}
