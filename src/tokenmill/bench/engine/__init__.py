"""Benchmarks of tokenmill's own engine, in process: against transformers, n choices, structured decoding."""
