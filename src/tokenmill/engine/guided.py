"""Structured outputs in the engine: a grammar matcher per constrained request (llguidance).

The frontend compiles `response_format` and forced tool calls into an llguidance grammar
(`SamplingParams.grammar`). The engine gives each such request a matcher on admission; a runner
asks `MaskComputer.start` for the batch's allowed-token masks before its forward pass and
collects them after it. They are filled on one thread, without the GIL, so while a forward pass
takes longer than the masks (it does, by orders of magnitude) they cost the step nothing. After
sampling, each token advances its request's matcher (`advance`); a matcher that can take
nothing more ends the request with `stop`.

Invariant: a constrained request's matcher has consumed exactly the request's output so far. A
migrated or imported request's prompt ends with tokens generated elsewhere (`output_offset`);
they are replayed into the new matcher on admission.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenmill.textgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Grammars:
    """Builds matchers for one engine's vocabulary (the token trie is built once, on first use)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltokenizer: Any = None

    def _ll(self) -> Any:
        import llguidance

        if self._lltokenizer is None:
            if self._tokenizer is None:
                raise ValueError("response_format: structured outputs need the engine's tokenizer")
            self._lltokenizer = llguidance.LLTokenizer(self._tokenizer.serialized(), n_vocab=self._vocab_size,
                                                       eos_token=self._eos or None)
        return self._lltokenizer

    def matcher(self, grammar: str, replay: Sequence[int] = ()) -> Any:
        """A matcher for `grammar` that has consumed `replay`; ValueError naming response_format."""
        import llguidance

        matcher = llguidance.LLMatcher(self._ll(), grammar)
        if matcher.is_error():
            raise ValueError(f"response_format: the grammar is invalid: {matcher.get_error()}")
        if replay and not matcher.consume_tokens(list(replay)):
            raise ValueError(f"response_format: the output so far does not match the grammar: {matcher.get_error()}")
        return matcher


def advance(matcher: Any, token: int) -> bool:
    """Feed the sampled token; True when the request must end (the grammar is complete, or broken)."""
    if not matcher.consume_token(token):
        # the mask allowed only tokens the grammar takes, so this means a bug, not bad input
        log.warning("grammar refused sampled token %d: %s", token, matcher.get_error())
        return True
    return matcher.is_stopped()


class MaskComputer:
    """Allowed-token masks for a batch's matchers, computed on a thread beside the forward pass."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.compute_seconds = 0.0  # summed over batches (a benchmark's view of the grammar's own cost)

    def start(self, matchers: Sequence[Any]) -> concurrent.futures.Future[np.ndarray]:
        """[len(matchers), vocab] bool, True where a token is allowed; collect with `.result()`."""
        return self._pool.submit(self.compute, list(matchers))

    def compute(self, matchers: Sequence[Any]) -> np.ndarray:
        import llguidance.numpy as llnp

        started = time.perf_counter()
        bitmask = llnp.allocate_token_bitmask(len(matchers), self.vocab_size)
        # One after another on this thread: a mask takes microseconds, and llguidance's parallel
        # executor wakes a thread per core, which on a CPU host fights the forward pass for cores
        # (measured on 2 cores: 8 masks 2.9 ms beside a forward pass, against ~20 us this way).
        for i, matcher in enumerate(matchers):
            llnp.fill_next_token_bitmask(matcher, bitmask, i)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        allowed = allowed.astype(bool)
        empty = ~allowed.any(axis=1)
        allowed[empty] = True  # a broken matcher: the request ends at `advance`, whatever is drawn
        self.compute_seconds += time.perf_counter() - started
        return allowed

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
