"""The fleet simulator: a request trace replayed over simulated workers.

Modules: `clock` (the step-time model as a per-step function, shared with the mock runner),
`arrivals` (request traces; `trace_files` reads them), `synthetic` (synthetic load), `block_chains` (the
prompts' chained block hashes, vectorised), `cache` (a worker's block-level prefix cache),
`worker` (continuous batching with chunked prefill, as the engine schedules), `replica`
(a worker's lifecycle and decode runs), `config` and `records` (what goes in and comes out), `fleet`
(the discrete-event loop: routing, disaggregation, KV transfers, fleet changes), `report`
(per-request, per-interval and total figures), `cli` and `plots` (`tokenmill sim fleet`).
"""
