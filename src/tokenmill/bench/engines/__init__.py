"""Serving engines on one load: tokenmill over vLLM against vLLM alone, KV routing over vLLM workers, the own engine against vLLM."""
