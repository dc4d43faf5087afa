"""The request plane's wire protocol: msgpack maps over ZeroMQ, never pickle.

Every message carries `type`; every request-scoped message carries `request_id`.
A token stream ends with a frame whose `finish_reason` says why
(stop, length, abort, error).

frontend -> worker: hello, generate, abort, kv_snapshot
worker -> frontend: tokens, error, heartbeat, kv_snapshot (the reply), batch
worker -> routers (PUB socket): kv_events

A `batch` carries `messages`, in order: what one side queued for the other in one event-loop
iteration — a worker's request-scoped frames (tokens, error, pinned) after an engine step, a
frontend's generates and aborts — so a busy step costs one ZeroMQ message per peer instead of
one per request.

Disaggregated serving adds two fields: a `generate` with `prefill_only` is answered by one
`tokens` frame with finish_reason "handoff" carrying `kv_handle` (where the prompt's KV can be
pulled from, ARCHITECTURE.md "KV transfer handle"); a `generate` with `kv_handle` continues such a
request on a decode worker, whose prompt then ends with the first token.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from tokenmill.textgen.outputs import RequestOutput
from tokenmill.textgen.sampling import SamplingParams, TokenLogprob

HELLO, GENERATE, ABORT = "hello", "generate", "abort"
TOKENS, ERROR, HEARTBEAT = "tokens", "error", "heartbeat"
KV_SNAPSHOT, KV_EVENTS = "kv_snapshot", "kv_events"
BATCH = "batch"
PIN, PINNED = "pin", "pinned"  # {request_id, prompt_token_ids} -> {request_id, ok, error}
TIERS = "tiers"  # {enabled}: store to and load from the KV tiers below the device pool, or not

# error codes a worker may answer a generate with
INVALID_REQUEST, OVERLOADED, INTERNAL = "invalid_request", "overloaded", "internal"


class ProtocolError(ValueError):
    """A frame that is not valid msgpack or lacks a required field."""


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("a frame must be a map with a string 'type'")
    return message


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def params_to_wire(params: SamplingParams, max_tokens: int | None = None) -> dict[str, Any]:
    """The parameters as a map (their values are plain lists, maps and numbers: no deep copy, which
    `dataclasses.asdict` would make on every request); `max_tokens` overrides (a migration's rest)."""
    wire = {name: getattr(params, name) for name in _PARAM_FIELDS}
    if max_tokens is not None:
        wire["max_tokens"] = max_tokens
    return wire


def generate_message(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     extra_key: str | None, output_offset: int, timeout_s: float | None,
                     text_pending: int = 0, prefill_only: bool = False,
                     kv_handle: dict[str, Any] | None = None, max_tokens: int | None = None) -> dict[str, Any]:
    return {"type": GENERATE, "request_id": request_id, "prompt_token_ids": list(prompt_token_ids),
            "params": params_to_wire(params, max_tokens), "extra_key": extra_key,
            "output_offset": output_offset, "text_pending": text_pending, "timeout_s": timeout_s,
            "prefill_only": prefill_only, "kv_handle": kv_handle}


def params_from_wire(raw: Any) -> SamplingParams:
    """Rebuild (and so re-validate) sampling parameters; ValueError on anything odd."""
    if not isinstance(raw, dict):
        raise ValueError("params must be a map")
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
    try:
        return SamplingParams(**raw)
    except TypeError as exc:
        raise ValueError(str(exc)) from exc


def tokens_message(out: RequestOutput, kv_handle: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"kv_handle": kv_handle, "type": TOKENS, "request_id": out.request_id, "token_ids": out.new_token_ids,
            "text": out.new_text, "finished": out.finished, "finish_reason": out.finish_reason,
            "num_prompt_tokens": out.num_prompt_tokens, "num_output_tokens": out.num_output_tokens,
            "num_cached_tokens": out.num_cached_tokens, "stop_reason": out.stop_reason,
            "text_pending": out.text_pending_tokens, "step_s": out.step_seconds,
            "logprobs": [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in out.new_logprobs]}


def output_from_wire(msg: dict[str, Any]) -> RequestOutput:
    try:
        return RequestOutput(
            request_id=msg["request_id"], new_token_ids=list(msg["token_ids"]), new_text=msg["text"],
            finished=bool(msg["finished"]), finish_reason=msg["finish_reason"],
            num_prompt_tokens=int(msg["num_prompt_tokens"]), num_output_tokens=int(msg["num_output_tokens"]),
            num_cached_tokens=int(msg["num_cached_tokens"]),
            new_logprobs=[TokenLogprob(t, lp, [(int(i), float(v)) for i, v in top])
                          for t, lp, top in msg.get("logprobs") or []],
            stop_reason=msg.get("stop_reason"), text_pending_tokens=int(msg.get("text_pending") or 0),
            step_seconds=float(msg.get("step_s") or 0.0),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed tokens frame: {exc}") from exc


def error_message(request_id: str, code: str, message: str) -> dict[str, Any]:
    return {"type": ERROR, "request_id": request_id, "code": code, "message": message}
