"""KV tiers below the device pool: host memory, local disk, shared storage (Redis, a directory).

Start at `base.py` (the contract), then `tokenmill.kv.tiered_manager` (the policy).
Modules: `host.HostTier`, `disk.DiskTier`, `shared_dir.SharedDirTier`,
`redis_tier.RedisTier`, `payload` (a device block as bytes and back), `record`
(the self-verifying stored form), `policy.BlockIndex` (eviction bookkeeping).
Nothing is re-exported here, so a process that only needs the disk tier does
not pay for importing torch.
"""
