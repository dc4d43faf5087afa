"""Admin routes: `POST /admin/pin` pins a prefix (a system prompt, a shared corpus) in every
worker's KV tiers, so it is never evicted from them and other replicas can load it.

Body: exactly one of `prompt` (a string, tokenized as `/v1/completions` does, or a list of
token ids) and `messages` (chat messages, rendered with the chat template and no generation
prompt, so the result is a prefix of any conversation that starts with them). Answer:
`{"pinned": bool, "num_tokens": n, "workers": {worker_id: null | "why not"}}`; `pinned` is
true when every worker pinned it. Only full KV blocks are pinned.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.frontend.body import read_body
from tokenmill.frontend.errors import invalid_param
from tokenmill.frontend.generation import ServingContext


def pin_token_ids(body: Any, tokenizer: Tokenizer) -> list[int]:
    """The token ids a pin request names; APIError (400) naming the field otherwise."""
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise invalid_param(None, "give exactly one of 'prompt' and 'messages'")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise invalid_param("messages", "'messages' must be a non-empty list of message objects")
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
    prompt = body["prompt"]
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise invalid_param("prompt", "'prompt' must be a non-empty string or list of token ids")


def admin_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/admin/pin")
    async def pin(request: Request) -> JSONResponse:
        raw = await read_body(request, ctx.max_body_bytes)
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise invalid_param(None, f"body is not JSON: {exc.msg}") from exc
        ids = await asyncio.to_thread(pin_token_ids, body, ctx.backend.tokenizer)
        if len(ids) >= ctx.backend.max_model_len:
            raise invalid_param("prompt", f"prefix has {len(ids)} tokens; the context length is "
                                          f"{ctx.backend.max_model_len}")
        workers = await ctx.backend.pin_prefix(ids)
        pinned = bool(workers) and all(why is None for why in workers.values())
        return JSONResponse({"pinned": pinned, "num_tokens": len(ids), "workers": workers})

    return router
