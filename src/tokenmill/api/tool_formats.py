"""The formats models write tool calls in: Hermes/Qwen `<tool_call>` JSON and Llama-3 JSON.

Each format writes the grammar that forces one call, reads calls out of finished text, and reads
them out of a stream (`CallStream`): text streams on as content until it could be the start of a
call; a call is emitted whole (name and arguments in one delta) once it is complete. A call that
does not parse stays content, as vLLM's parsers leave it.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI `tool_calls` entry (arguments as the JSON string OpenAI sends)."""
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class ToolFormat:
    name = ""
    arguments_key = "arguments"

    def call_schema(self, functions: list[dict[str, Any]]) -> dict[str, Any]:
        """One call to any of `functions`: {"name": its name, <arguments_key>: its parameters}."""
        options = [{"type": "object", "additionalProperties": False, "required": ["name", self.arguments_key],
                    "properties": {"name": {"const": f["name"]}, self.arguments_key: f["parameters"]}}
                   for f in functions]
        return {**(options[0] if len(options) == 1 else {"anyOf": options}), **_COMPACT}

    def call_grammar(self, functions: list[dict[str, Any]]) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls) of a finished output."""
        raise NotImplementedError

    def system_prompt(self, functions: list[dict[str, Any]]) -> str:
        raise NotImplementedError

    def write_call(self, name: str, arguments: Any) -> str:
        raise NotImplementedError

    def tool_result(self, content: str) -> str:
        return content

    def _call_of(self, raw: str) -> dict[str, Any] | None:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get(self.arguments_key, obj.get("arguments", obj.get("parameters", {})))
        return new_call(obj["name"], arguments) if isinstance(arguments, dict) else None


class HermesFormat(ToolFormat):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Hermes, Qwen 2.5/3)."""
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def call_grammar(self, functions: list[dict[str, Any]]) -> str:
        schema = json.dumps(self.call_schema(functions))
        return f'start: "{self.OPEN}\\n" %json{schema} "\\n{self.CLOSE}"'

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        calls = []
        for match in self._CALL.finditer(text):
            call = self._call_of(match.group(1))
            if call is None:
                return text, []
            calls.append(call)
        content = self._CALL.sub("", text).strip() if calls else text
        return content or None, calls

    def system_prompt(self, functions: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
        return ("You may call one or more functions to assist with the user query.\n"
                f"The functions you can call are listed in <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
                "For each call, return a JSON object with the function name and arguments within "
                f'{self.OPEN}{self.CLOSE} tags:\n{self.OPEN}\n{{"name": <function-name>, '
                f'"arguments": <args-json-object>}}\n{self.CLOSE}')

    def write_call(self, name: str, arguments: Any) -> str:
        return f"{self.OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{self.CLOSE}"

    def tool_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3JsonFormat(ToolFormat):
    """A bare `{"name": ..., "parameters": {...}}` object, optionally after `<|python_tag|>` (Llama 3.1+)."""
    name = "llama3_json"
    arguments_key = "parameters"
    TAG = "<|python_tag|>"

    def call_grammar(self, functions: list[dict[str, Any]]) -> str:
        return f"start: %json{json.dumps(self.call_schema(functions))}"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text or None, []
        calls = [self._call_of(part) for part in body.split("; ")] if "}; {" in body else [self._call_of(body)]
        if any(c is None for c in calls):
            return text, []
        return None, [c for c in calls if c is not None]

    def system_prompt(self, functions: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps({"type": "function", "function": f}, indent=2) for f in functions)
        return ("When you receive a tool call response, use the output to answer the original question.\n"
                "Given the following functions, respond with a JSON for a function call with its proper "
                'arguments that best answers the given prompt.\nRespond in the format {"name": function name, '
                f'"parameters": dictionary of argument name and its value}}. Do not use variables.\n\n{listed}')

    def write_call(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments})


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}


@dataclass(slots=True)
class CallStream:
    """One choice's streamed text, split into content deltas and whole calls."""
    format: ToolFormat
    held: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    _mode: str | None = None  # Llama-3 JSON: "call" (the output opened like one: all held), "content"

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, calls completed now)."""
        self.held += text
        if isinstance(self.format, HermesFormat):
            return self._hermes(finished)
        return self._whole(finished)

    def _hermes(self, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        fmt = self.format
        content, done = "", []
        while True:
            start = self.held.find(HermesFormat.OPEN)
            if start < 0:
                keep = 0 if finished else _partial_suffix(self.held, HermesFormat.OPEN)
                content += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return content, done
            end = self.held.find(HermesFormat.CLOSE, start)
            if end < 0:
                if finished:  # an unclosed call is text
                    content, self.held = content + self.held, ""
                else:
                    content, self.held = content + self.held[:start], self.held[start:]
                return content, done
            end += len(HermesFormat.CLOSE)
            _, calls = fmt.parse(self.held[start:end])
            content += self.held[:start] if calls else self.held[:end]
            done += calls
            self.calls += calls
            self.held = self.held[end:]

    def _whole(self, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        if self._mode is None:
            opening = self.held.lstrip()
            if opening.startswith(("{", Llama3JsonFormat.TAG)):
                self._mode = "call"
            elif opening and not Llama3JsonFormat.TAG.startswith(opening):
                self._mode = "content"
        if self._mode == "content" or (finished and self._mode is None):
            content, self.held = self.held, ""
            return content, []
        if not finished:
            return "", []
        content, calls = self.format.parse(self.held)
        self.held = ""
        self.calls += calls
        return content or "", calls


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
