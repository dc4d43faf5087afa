"""The harness every benchmark shares: a server process, the load generator, statistics, observers of a running server, the serve report, trace replay."""
