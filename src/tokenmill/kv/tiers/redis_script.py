"""The Lua script that keeps the Redis tier's index inside Redis itself, atomically.

Several workers write one Redis tier; the capacity, the LRU order, the
parent/child counts and the pins therefore live next to the blocks, and every
mutation is one script call (Redis runs a script atomically). Keys, under the
tier's namespace `ns`:

    ns:b:<hash hex>   the block record (see record.py)
    ns:lru            zset hash -> logical clock of last use
    ns:size, ns:parent, ns:kids   hashes: record bytes, parent hash, children present
    ns:pin            set of pinned hashes      ns:used   bytes stored      ns:clock

Eviction walks the LRU zset oldest first, skipping pinned blocks and blocks
with children present (and the parent of the block being stored); evicting a child can free its parent, so it walks again
(a bounded number of passes) until the new block fits or nothing more can go.
"""
from __future__ import annotations

KEY_SUFFIXES: tuple[str, ...] = ("lru", "size", "parent", "kids", "pin", "used", "clock")

TIER_SCRIPT = r"""
local lru, size_k, par_k, kids_k, pin_k, used_k, clock_k =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local op, blob_prefix = ARGV[1], ARGV[2]

local function remove(h)
  if redis.call('DEL', blob_prefix .. h) == 0 and not redis.call('ZSCORE', lru, h) then
    return 0
  end
  redis.call('ZREM', lru, h)
  redis.call('DECRBY', used_k, tonumber(redis.call('HGET', size_k, h) or '0'))
  redis.call('HDEL', size_k, h)
  local parent = redis.call('HGET', par_k, h)
  if parent then
    redis.call('HDEL', par_k, h)
    if redis.call('HINCRBY', kids_k, parent, -1) <= 0 then redis.call('HDEL', kids_k, parent) end
  end
  return 1
end

local function evictable(h)
  return redis.call('SISMEMBER', pin_k, h) == 0 and not redis.call('HGET', kids_k, h)
end

local function make_room(need, cap, evicted, protect)
  for pass = 1, 8 do
    local used = tonumber(redis.call('GET', used_k) or '0')
    if used + need <= cap then return true end
    local progressed = false
    for _, c in ipairs(redis.call('ZRANGE', lru, 0, 1023)) do
      if used + need <= cap then break end
      if c ~= protect and evictable(c) then
        used = used - tonumber(redis.call('HGET', size_k, c) or '0')
        remove(c)
        table.insert(evicted, c)
        progressed = true
      end
    end
    if not progressed then break end
  end
  return tonumber(redis.call('GET', used_k) or '0') + need <= cap
end

if op == 'put' then
  local h, val, parent, cap = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
  local now = redis.call('INCR', clock_k)
  if redis.call('EXISTS', blob_prefix .. h) == 1 then
    redis.call('ZADD', lru, now, h)
    return {1, 0}
  end
  local need = string.len(val)
  local evicted = {}
  if need > cap or not make_room(need, cap, evicted, parent) then return {0, 0, unpack(evicted)} end
  redis.call('SET', blob_prefix .. h, val)
  redis.call('ZADD', lru, now, h)
  redis.call('HSET', size_k, h, need)
  redis.call('INCRBY', used_k, need)
  if parent ~= '' then
    redis.call('HSET', par_k, h, parent)
    redis.call('HINCRBY', kids_k, parent, 1)
  end
  return {1, 1, unpack(evicted)}
elseif op == 'get' then
  local val = redis.call('GET', blob_prefix .. ARGV[3])
  if val then redis.call('ZADD', lru, redis.call('INCR', clock_k), ARGV[3]) end
  return val
elseif op == 'del' then
  return remove(ARGV[3])
elseif op == 'pin' then
  local cap, fresh = tonumber(ARGV[3]), {}
  for i = 4, #ARGV do
    if redis.call('SISMEMBER', pin_k, ARGV[i]) == 0 then table.insert(fresh, ARGV[i]) end
  end
  if redis.call('SCARD', pin_k) + #fresh > cap then return 0 end
  for _, h in ipairs(fresh) do redis.call('SADD', pin_k, h) end
  return 1
end
return redis.error_reply('unknown op ' .. tostring(op))
"""
