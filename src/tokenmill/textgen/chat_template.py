"""Chat templates rendered the way transformers renders them, without importing transformers.

A checkpoint's chat template is untrusted Jinja from the Hub, written against transformers'
environment: a sandbox with `trim_blocks`/`lstrip_blocks`, `loopcontrols`, a `{% generation %}`
tag, a `tojson` that does not HTML-escape, and the globals `raise_exception`, `strftime_now`,
`dict` and `namespace`. The context is the conversation (message objects turned into plain dicts,
keys whose value is None dropped, reasoning copied under the names templates read), `tools`,
`documents`, `add_generation_prompt`, the tokenizer's named special tokens and the caller's extra
variables. Any difference would change the prompt a model sees, so each step below mirrors
transformers 5 (`utils/chat_template_utils.py`, `PreTrainedTokenizerBase.apply_chat_template`).

Importing this module costs ~30 ms (jinja2's sandbox), so `tokenizer.py` imports it only when a
chat is first rendered.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

Templates = str | dict[str, str]

# Older jinja2 releases have known sandbox escapes; transformers refuses them too.
MIN_JINJA_VERSION = (3, 1, 6)
# Names a message's reasoning arrives under; the first is the one most templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the message being continued so its end can be found in the rendered text.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# transformers' apply_chat_template arguments that steer tokenization, never template variables.
_CALL_OPTIONS = ("return_dict", "padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs")
_UNSUPPORTED_OPTIONS = ("sanitize_control_tokens", "return_assistant_tokens_mask")


def render_conversation(templates: Templates, conversation: Any, special_tokens: Mapping[str, str],
                        add_generation_prompt: bool = False, **kwargs: Any) -> str:
    """The prompt text for one conversation; ValueError/TypeError on bad input or a template error.

    `special_tokens` are the tokenizer's named special tokens (bos_token, eos_token, ...); caller
    kwargs override them, as in transformers. `chat_template` picks a named template or passes one.
    """
    _drop_call_options(kwargs)
    tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
    continue_final = kwargs.pop("continue_final_message", False)
    template = select_template(templates, kwargs.pop("chat_template", None), tools)
    messages = _normalize_messages(conversation)
    if continue_final and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    variables = _plain({**special_tokens, **kwargs})
    chat = _alias_reasoning(_plain(messages))
    continued = _tag_final_message(chat, continue_final, template) if continue_final else None
    try:
        text = _compile(template).render(messages=chat, tools=_tool_schemas(tools),
                                         documents=_checked_documents(documents),
                                         add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template: {exc}") from exc
    return _cut_at_tag(text, continued) if continued is not None else text


def select_template(templates: Templates, name: str | None, tools: Any) -> str:
    """The template to render: a named one, `tool_use` when tools are given, else `default`.

    A `name` that is not one of the checkpoint's templates is itself a template, as in transformers.
    """
    if not isinstance(templates, dict):
        return templates if name is None else name
    if name is not None:
        return templates.get(name, name)
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ValueError("the checkpoint has several chat templates and none is named 'default'; pass "
                     f"chat_template=<name>, one of {sorted(templates)}")


def _drop_call_options(kwargs: dict[str, Any]) -> None:
    """Remove the tokenization options transformers would consume, refusing the ones we lack."""
    if "tokenize" in kwargs:
        raise TypeError("apply_chat_template() got an unexpected keyword argument 'tokenize'")
    for key in _UNSUPPORTED_OPTIONS:
        if kwargs.pop(key, False):
            raise ValueError(f"{key}=True is not supported")
    for key in _CALL_OPTIONS:
        kwargs.pop(key, None)


def _normalize_messages(conversation: Any) -> list[dict[str, Any]]:
    """Messages as dicts (dataclasses and pydantic models converted), None-valued keys dropped.

    OpenAI-style clients send `content=None` or `tool_calls=None`; many templates render those as
    the text "None" but handle a missing key, which is why transformers drops them.
    """
    messages = _objects_to_dicts(getattr(conversation, "messages", conversation))
    if isinstance(messages, (list, tuple)) and not messages:
        raise ValueError("cannot apply the chat template to an empty conversation")
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, dataclasses or pydantic models, got {message!r}")
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


def _objects_to_dicts(value: Any) -> Any:
    """Mappings, dataclasses and pydantic models (anything with `model_dump`) as nested dicts."""
    if isinstance(value, Mapping):
        return {key: _objects_to_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_objects_to_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_objects_to_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _objects_to_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types; anything else becomes the inert text "<TypeName>".

    The sandbox does not know which methods of arbitrary objects are dangerous, so templates only
    ever see str/int/float/bool/None, dicts, lists and tuples.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (str enums, numpy strings) lose their extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar can only exist if numpy was imported
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy a message's reasoning to `reasoning_content` (most templates) and `thinking` (gpt-oss)."""
    aliased = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _tool_schemas(tools: Any) -> Any:
    """JSON-schema tools as given; Python functions converted by transformers' docstring parser."""
    if tools is None:
        return None
    schemas = []
    for tool in tools:
        if isinstance(tool, dict):
            schemas.append(tool)
        elif inspect.isfunction(tool) or inspect.ismethod(tool):
            # Rare outside notebooks; the parser is long, so use transformers' own (imported here only).
            from transformers.utils.chat_template_utils import get_json_schema
            schemas.append(get_json_schema(tool))
        else:
            raise ValueError("tools must be JSON schemas or functions with type hints and a docstring")
    return _plain(schemas)


def _checked_documents(documents: Any) -> Any:
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
    return _plain(documents)


def _tag_final_message(chat: list[dict[str, Any]], continue_final: bool | str, template: str) -> str:
    """Mark the end of the message to continue (mutating `chat`, a private copy); its text.

    `continue_final` names the field to continue (True: `content`). Reasoning is copied under
    several names, so every copy is tagged and the template may read any of them.
    """
    field = continue_final if isinstance(continue_final, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue')
    fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final] if field in REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}", which the chat template never reads')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + CONTINUE_TAG
                return final
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    for f in fields:
        chat[-1][f] = chat[-1][f] + CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    """The rendered chat up to the continued message's end (the template may trim the tag's space)."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message is set but the chat template dropped part of the final message")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it (for
    training masks); rendering a prompt only needs the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` / `dict.fromkeys(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace()`, refusing underscore names (a way to reach CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no `self`, as jinja's: namespace(self=...) works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Plain json.dumps: jinja's own `tojson` HTML-escapes, which would change the prompt."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """The compiled template (compiling costs milliseconds; a server renders the same one per request)."""
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < MIN_JINJA_VERSION:
        raise ImportError(f"chat templates need jinja2>={'.'.join(map(str, MIN_JINJA_VERSION))}, "
                          f"found {jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template: {exc}") from exc
