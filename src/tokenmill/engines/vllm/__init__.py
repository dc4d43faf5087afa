"""vLLM behind tokenmill's worker: its v1 `AsyncLLM` in the worker process (`adapter.py`), its KV
events re-hashed into tokenmill's block-hash contract (`events.py`), its scheduler stats as the
worker's load (`stats.py`), tokenmill's sampling parameters and outputs mapped one to one
(`requests.py`), and its engine options passed through (`options.py`).

Every module here imports vLLM, so it runs only in the engine's own venv (`make install-vllm`);
the rest of tokenmill never imports this package outside a vLLM worker.
"""
