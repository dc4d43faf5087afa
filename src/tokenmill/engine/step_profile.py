"""Where an engine step's time goes, by operator class, without an external profiler.

`StepProfiler(engine)` attaches for a `with` block: forward hooks on the model's modules and
timed wrappers on this engine's scheduler and runner (instance attributes only, removed on
exit). Time is *exclusive*: a section's clock pauses while a nested one runs, so the classes
add up to the step's wall time. Steps are split into `decode` (every sequence decodes one
token) and `prefill` (the step computes prompt tokens, with or without decodes beside them).

Classes: attention (rotary, KV write, paged attention: the attention module minus its
projections), experts (MoE router and experts), dense (every other linear: q/k/v/o, dense MLP,
LM head), norms (RMSNorm, embedding), model glue (residual adds, row selection), inputs (the
runner's step tensors), sampling (logits to tokens), scheduling, and engine (the rest of
`LLMEngine.step`: output processing, detokenization, Python between the parts).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tokenmill.engine.models.layers import RMSNorm
from tokenmill.engine.models.moe import SparseMoE
from tokenmill.engine.models.transformer import Attention, CausalLM

CLASSES = ("attention", "experts", "dense", "norms", "model glue", "inputs", "sampling", "scheduling", "engine")
KINDS = ("decode", "prefill")


@dataclass(slots=True)
class StepBreakdown:
    """Seconds per class, summed over `steps` steps of one kind."""
    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0.0))

    def mean_ms(self) -> dict[str, float]:
        return {name: s / max(self.steps, 1) * 1e3 for name, s in self.seconds.items()}


class _Clock:
    """Exclusive time per class: entering a section charges the time so far to the one it interrupts."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.spent: dict[str, float] = defaultdict(float)
        self.last = time.perf_counter()

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        if self.stack:
            self.spent[self.stack[-1]] += now - self.last
        self.stack.append(name)
        self.last = now

    def leave(self) -> None:
        now = time.perf_counter()
        self.spent[self.stack.pop()] += now - self.last
        self.last = now


def _module_class(module: nn.Module, inside_moe: bool) -> str | None:
    if isinstance(module, SparseMoE) or inside_moe:
        return "experts" if isinstance(module, SparseMoE) else None  # the experts' gate counts as experts
    if isinstance(module, nn.Linear):
        return "dense"
    if isinstance(module, (RMSNorm, nn.Embedding)):
        return "norms"
    if isinstance(module, Attention):
        return "attention"
    if isinstance(module, CausalLM):
        return "model glue"
    return None


class StepProfiler:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.breakdown = {kind: StepBreakdown() for kind in KINDS}
        self._clock = _Clock()
        self._handles: list[Any] = []
        self._patched: list[tuple[Any, str]] = []
        self._decode_steps_seen = engine.stats().num_decode_only_steps

    def __enter__(self) -> StepProfiler:
        self._hook_modules(self.engine.runner.model)
        for scheduler in self.engine.schedulers:  # one per attention-DP rank
            self._wrap(scheduler, "schedule", "scheduling")
        self._wrap(self.engine.runner, "_prepare", "inputs")
        # what the model and inputs leave of the runner's call is sampling
        self._wrap(self.engine.runner, "execute_ranks" if len(self.engine.schedulers) > 1 else "execute",
                   "sampling")
        self._wrap(self.engine, "step", "engine", self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        for owner, name in self._patched:
            delattr(owner, name)  # back to the class's method
        self._handles, self._patched = [], []

    def _hook_modules(self, model: nn.Module) -> None:
        moe_members = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE) for m in moe.modules()}
        for module in model.modules():
            name = _module_class(module, id(module) in moe_members)
            if name is not None:
                self._handles.append(module.register_forward_pre_hook(lambda *_, n=name: self._clock.enter(n)))
                self._handles.append(module.register_forward_hook(lambda *_: self._clock.leave()))

    def _wrap(self, owner: Any, method: str, name: str, after: Any = None) -> None:
        original = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._clock.enter(name)
            try:
                return original(*args, **kwargs)
            finally:
                self._clock.leave()
                if after is not None:
                    after()

        setattr(owner, method, timed)
        self._patched.append((owner, method))

    def _record(self) -> None:
        """After a step: its exclusive times go to its kind (the last scheduled step's)."""
        spent, self._clock.spent = self._clock.spent, defaultdict(float)
        if "sampling" not in spent:
            return  # nothing was scheduled, so nothing ran
        decode_steps = self.engine.stats().num_decode_only_steps
        kind = "decode" if decode_steps > self._decode_steps_seen else "prefill"
        self._decode_steps_seen = decode_steps
        part = self.breakdown[kind]
        part.steps += 1
        for cls, seconds in spent.items():
            part.seconds[cls] += seconds
