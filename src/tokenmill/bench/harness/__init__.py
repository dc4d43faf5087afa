"""What more than one benchmark family shares: a server process, the load generator, statistics,
observers of a running server, the serve report, trace replay, and the shared workloads (a
shared-prefix text load, synthetic KV-event chains) and checkpoint helpers."""
