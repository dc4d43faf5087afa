"""The frontend's client of worker processes: the worker pool (discovery, heartbeats, KV
events into the routers), the distributed backend (routing, migration, remote prefill), and
the supervision and runtime scaling of `tokenmill serve`'s workers. It knows nothing of HTTP:
the API layer (`tokenmill.api`) turns what it raises into responses."""
