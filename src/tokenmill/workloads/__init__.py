"""Synthetic request streams that benchmarks, the fleet simulator and the dashboard's demo
scenarios share: prompts built from hash-block specs (`prompt_synth`) and the demo's named
scenarios (`demo`). Imports no serving package, so any of them may use it."""
