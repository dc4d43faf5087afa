"""Moving and keeping KV: disaggregated serving, transfers between processes, the KV tiers."""
