"""Tool calling: `tools` and `tool_choice` checked, the tools shown to the model, its calls read back.

The tools reach the model through its own chat template (`tools=` as in transformers). A
template that never mentions tools gets them as a system message in the call format instead,
so the model still sees them. What the model writes is read by its format's parser
(`tool_formats.py`: Hermes/Qwen `<tool_call>` JSON, or Llama-3 JSON). `required` and a named
function are enforced: the grammar engine makes the output one call in that format, to one of
the allowed functions, with arguments matching its `parameters` schema. With `none` the tools
are not shown, and with `auto` the model may answer in text.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from tokenmill.api.errors import invalid_param
from tokenmill.api.structured import ANY_OBJECT, check_name, check_schema, checked
from tokenmill.api.tool_formats import FORMATS, ToolFormat
from tokenmill.textgen.tokenizer import Tokenizer

CHOICES = ("none", "auto", "required")


@dataclass(slots=True)
class ToolCalling:
    """A request's tools and what it allows: `choice` is none, auto, required or named (`name`)."""
    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}} entries, checked
    choice: str
    name: str | None
    format: ToolFormat

    @property
    def shown(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> str | None:
        """The grammar forcing a call (required, named); None when the model may answer freely."""
        if self.choice not in ("required", "named"):
            return None
        functions = [t["function"] for t in self.tools
                     if self.choice == "required" or t["function"]["name"] == self.name]
        return checked(self.format.call_grammar(functions), "tool_choice")


def tool_calling(tools: list[dict[str, Any]] | None, tool_choice: Any, tokenizer: Tokenizer,
                 parser: str | None = None) -> ToolCalling | None:
    """The request's tool calling, or None without tools; a 400 naming the field on bad input."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid_param("tool_choice", "tool_choice needs tools")
        return None
    checked_tools = [_check_tool(i, tool) for i, tool in enumerate(tools)]
    names = [t["function"]["name"] for t in checked_tools]
    if len(set(names)) != len(names):
        raise invalid_param("tools", "tool function names must be unique")
    choice, name = _check_choice(tool_choice, names)
    return ToolCalling(checked_tools, choice, name, FORMATS[parser or detect_format(tokenizer)])


def detect_format(tokenizer: Tokenizer) -> str:
    """The call format the checkpoint's chat template teaches its model (Hermes when it shows none)."""
    template = tokenizer.chat_template_text
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid_param(f"{where}.type", f"{where}.type must be 'function'")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid_param(f"{where}.function", f"{where}.function must be an object")
    check_name(function.get("name"), f"{where}.function.name")
    if not isinstance(function.get("description", ""), str):
        raise invalid_param(f"{where}.function.description", "description must be a string")
    out = copy.deepcopy(function)
    out["parameters"] = check_schema(function.get("parameters", ANY_OBJECT), f"{where}.function.parameters")
    return {"type": "function", "function": out}


def _check_choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise invalid_param("tool_choice", f"tool_choice must be one of {', '.join(CHOICES)} or a function, "
                                               f"got {tool_choice!r}")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise invalid_param("tool_choice", 'tool_choice must name a function: {"type": "function", '
                                           '"function": {"name": ...}}')
    if name not in names:
        raise invalid_param("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return "named", name


def render_messages(messages: list[dict[str, Any]], calling: ToolCalling | None,
                    tokenizer: Tokenizer) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, template arguments): the tools as the template's `tools`, or folded into the
    messages for a template that knows no tools (and so would drop them, calls and results too)."""
    if calling is None or not calling.shown:
        return messages, {}
    if "tools" in tokenizer.chat_template_text:
        return [_arguments_as_objects(m) for m in messages], {"tools": calling.tools}
    fmt = calling.format
    folded = [{"role": "system", "content": fmt.system_prompt([t["function"] for t in calling.tools])}]
    for message in messages:
        if message.get("role") == "tool":
            folded.append({"role": "user", "content": fmt.tool_result(str(message.get("content") or ""))})
        elif message.get("tool_calls"):
            calls = "".join(fmt.write_call(c["function"]["name"], _arguments(c)) for c in message["tool_calls"])
            folded.append({"role": "assistant", "content": (message.get("content") or "") + calls})
        else:
            folded.append(message)
    return folded, {}


def _arguments(call: dict[str, Any]) -> Any:
    raw = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Templates print a call's arguments with `tojson`: give them the object, not OpenAI's string."""
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}
