"""From a validated request body to what the backend takes: prompt token ids and SamplingParams.

Every refusal here is a 400 that names the request field, including fields OpenAI
defines that tokenmill does not implement (best_of, echo, suffix):
silently ignoring them would return something the client did not ask for.
"""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

import jinja2

from tokenmill.api.errors import APIError, from_value_error, invalid_param
from tokenmill.api.schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    TextContentPart,
)
from tokenmill.api.structured import response_format_grammar
from tokenmill.api.tools import ToolCalling, render_messages
from tokenmill.textgen.sampling import SamplingParams
from tokenmill.textgen.tokenizer import Tokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16  # n × prompts per request: beyond it a client should send several requests
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; the engine would take more, the API does not
# Prompts up to this many characters are tokenized on the event loop (tens of microseconds);
# longer ones on a thread, so a long prompt cannot stall every other stream. The thread
# hop costs more than tokenizing a short prompt, and contends for the GIL besides.
INLINE_TOKENIZE_CHARS = 8192

BodyT = TypeVar("BodyT")


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(404, f"The model `{requested}` does not exist; this server serves `{served}`",
                       param="model", code="model_not_found")


def check_request(body: SamplingFields, served_model: str) -> None:
    check_model(body.model, served_model)
    reject_unsupported(body)


def reject_unsupported(body: SamplingFields) -> None:
    """OpenAI fields we cannot honour, each only when set to something other than its no-op value."""
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise invalid_param("n", f"n must be between 1 and {MAX_CHOICES}, got {body.n}")
    unsupported: list[tuple[str, bool, str]] = []
    if isinstance(body, CompletionRequest):
        unsupported += [("best_of", body.best_of not in (None, 1), "only best_of=1 is supported"),
                        ("echo", bool(body.echo), "echo is not supported"),
                        ("suffix", bool(body.suffix), "suffix is not supported")]
    for param, refused, message in unsupported:
        if refused:
            raise invalid_param(param, message)


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None,
                    aliases: dict[str, str], grammar: str | None = None) -> SamplingParams:
    """The engine's parameters; `grammar` (a forced tool call's) wins over `response_format`'s.
    A request without a seed is given one here, and the response returns it (`seed`): sampling
    depends only on the seed, the token's index and the logits, so any answer can be replayed.
    (The Responses API takes no seed, as OpenAI's, and returns none.)"""
    if body.temperature is not None and not 0.0 <= body.temperature <= MAX_TEMPERATURE:
        raise invalid_param("temperature", f"temperature must be between 0 and {MAX_TEMPERATURE:g}, "
                                           f"got {body.temperature}")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=secrets.randbits(63) if body.seed is None else body.seed,
            stop=body.stop or [],
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=dict(body.logit_bias or {}),
            grammar=grammar or response_format_grammar(body.response_format),
        )
    except ValueError as exc:
        raise from_value_error(exc, aliases) from exc


def check_context_length(prompt: list[int], max_model_len: int, param: str) -> None:
    if not prompt:
        raise invalid_param(param, f"{param} must not be empty")
    if len(prompt) >= max_model_len:
        raise invalid_param(param, f"This model's maximum context length is {max_model_len} tokens, but the "
                                   f"{param} has {len(prompt)} tokens (and at least one token must be generated)",
                            code="context_length_exceeded")


def prompt_chars(prompt: Any) -> int:
    """The characters a prompt, or a chat's messages, hold: what tokenizing it will cost."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, ChatMessage):
        return prompt_chars(prompt.content)
    if isinstance(prompt, TextContentPart):
        return len(prompt.text)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # token ids need none
        return sum(prompt_chars(part) for part in prompt)
    return 0


async def tokenized(tokenize: Callable[[BodyT, Tokenizer], list[int]], body: BodyT, tokenizer: Tokenizer,
                    chars: int) -> list[int]:
    """`tokenize(body, tokenizer)`: inline for short prompts, on a thread for long ones."""
    if chars <= INLINE_TOKENIZE_CHARS:
        return tokenize(body, tokenizer)
    return await asyncio.to_thread(tokenize, body, tokenizer)


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """The request's prompts as token ids: one string or id list, or a list of them."""
    prompt: Any = body.prompt
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = list(prompt) if several else [prompt]
    if len(prompts) * (body.n or 1) > MAX_CHOICES:
        raise invalid_param("prompt", f"at most {MAX_CHOICES} choices per request (prompts x n), "
                                      f"got {len(prompts)} x {body.n or 1}")
    return [(tokenizer.encode(p) if p else []) if isinstance(p, str) else list(p) for p in prompts]


def completion_limits(body: CompletionRequest, prompt_len: int, max_model_len: int) -> tuple[int, int | None]:
    """(max tokens, engine logprobs). An explicit max_tokens the context cannot hold is refused,
    as OpenAI and vLLM do; the default (16) is cut to what fits."""
    if body.max_tokens is None:
        return max(1, min(DEFAULT_COMPLETION_MAX_TOKENS, max_model_len - prompt_len)), body.logprobs
    check_room(prompt_len, body.max_tokens, max_model_len, "max_tokens", "prompt")
    return body.max_tokens, body.logprobs


def check_room(prompt_len: int, max_tokens: int, max_model_len: int, param: str, prompt_param: str) -> None:
    """prompt + max_tokens must fit the context: a 400 naming the limit's field otherwise."""
    if isinstance(max_tokens, int) and max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise invalid_param(param, f"This model's maximum context length is {max_model_len} tokens. However, you "
                                   f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, "
                                   f"{max_tokens} in the completion). Please reduce the length of the "
                                   f"{prompt_param} or {param}.", code="context_length_exceeded")


def chat_prompt(body: ChatCompletionRequest, tokenizer: Tokenizer, calling: ToolCalling | None = None) -> list[int]:
    for i, message in enumerate(body.messages):
        if message.role in ("system", "developer", "user") and message.content is None:
            raise invalid_param(f"messages[{i}].content", f"a {message.role} message must have content")
    messages = [_template_message(m.model_dump(exclude_none=True)) for m in body.messages]
    messages, template_args = render_messages(messages, calling, tokenizer)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_args)
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        raise invalid_param("messages", f"messages cannot be rendered with the chat template: {exc}") from exc


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):  # text parts are the only kind the schema admits
        message["content"] = "".join(part["text"] for part in content)
    return message


def chat_limits(body: ChatCompletionRequest, prompt_len: int, max_model_len: int) -> tuple[int, int | None, str]:
    """(max tokens, engine logprobs, which field set the limit): unset means "up to the context length"."""
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = max(1, max_model_len - prompt_len) if requested is None else requested
    if requested is not None:
        check_room(prompt_len, requested, max_model_len, field, "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_param("top_logprobs", "top_logprobs requires logprobs to be true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return max_tokens, logprobs, field
