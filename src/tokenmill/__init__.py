"""tokenmill: serve large language models at the lowest cost per token inside a latency SLA."""

__version__ = "0.1.0"
