"""Per-request stop checks and text deltas after each engine step.

Stop conditions, in order: a stop token id, an end-of-sequence token (unless
`ignore_eos`), `max_tokens`, the context length, then stop strings. A stop string
is cut from the text (as the OpenAI API does); while stop strings are set, the
last `len(longest stop) - 1` characters are held back so a stop string split
across tokens is never streamed.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.request import Request
from tokenmill.textgen.detokenizer import IncrementalDetokenizer
from tokenmill.textgen.outputs import FINISH_LENGTH, FINISH_STOP
from tokenmill.textgen.tokenizer import Tokenizer


@dataclass(slots=True)
class _TextState:
    detok: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._text: dict[str, _TextState] = {}

    def add(self, request: Request) -> None:
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, pending=request.text_pending)
            self._text[request.request_id] = _TextState(detok)

    def pending_tokens(self, request_id: str) -> int:
        state = self._text.get(request_id)
        return state.detok.pending_tokens if state is not None else 0

    def holds_text(self, request_id: str) -> bool:
        """True when some of the request's text has not been emitted yet (an incomplete
        character, or characters held back because a stop string might start there)."""
        state = self._text.get(request_id)
        return state is not None and (state.emitted < len(state.text) or state.detok.pending_tokens > 0)

    def remove(self, request_id: str) -> None:
        self._text.pop(request_id, None)

    def check_token_stop(self, request: Request, token: int) -> tuple[str, int | None] | None:
        """(finish reason, stop token) if appending `token` ends the request."""
        params = request.params
        if token in params.stop_token_ids:
            return FINISH_STOP, token
        if not params.ignore_eos and token in self.eos_token_ids:
            return FINISH_STOP, None
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FINISH_LENGTH, None
        return None

    def text_delta(self, request: Request, new_tokens: list[int], finished: bool) -> tuple[str, str | None]:
        """(new text, matched stop string or None). A matched stop string finishes the request."""
        state = self._text.get(request.request_id)
        if state is None:
            return "", None
        stops = request.params.stop
        before = len(state.text)
        state.text += state.detok.add(new_tokens)
        if finished:
            state.text += state.detok.flush()
        matched = None
        if stops:
            matched = self._cut_at_stop(state, stops, before)
        hold = 0 if (finished or matched) else max((len(s) for s in stops), default=1) - 1
        end = max(state.emitted, len(state.text) - hold)
        delta, state.emitted = state.text[state.emitted:end], end
        return delta, matched

    @staticmethod
    def _cut_at_stop(state: _TextState, stops: list[str], before: int) -> str | None:
        longest = max(len(s) for s in stops)
        window_start = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for stop in stops:
            idx = state.text.find(stop, window_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        state.text = state.text[:best[0]]
        return best[1]
