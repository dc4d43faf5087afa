"""The OpenAI-compatible HTTP surface of a frontend process: routes, request parsing and
validation, streaming, tools and structured outputs, error JSON, Prometheus metrics, the admin
routes and the dashboard. It serves from a `tokenmill.backend.Backend` (one embedded engine,
or `tokenmill.fleet`'s client of worker processes) and starts a frontend process (`launch.py`).
It may import `fleet`; `fleet` never imports it."""
