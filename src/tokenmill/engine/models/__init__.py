"""Model implementations for HF architectures (one decoder skeleton, per-family options)."""
