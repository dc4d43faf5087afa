"""The serving path: the load generator against an OpenAI server, and the frontend's hot path under wrk."""
