"""Tokenizer's `tokenizers` backend against transformers' AutoTokenizer, the independent reference.

Checkpoints that transformers would load as a plain TokenizersBackend are read without importing
transformers; ids, text, special/eos ids, vocabulary size and rendered chat templates must equal
AutoTokenizer's. Checkpoints needing more go through transformers and must still work.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jinja2
import pytest
from transformers import AutoTokenizer

from tokenmill.textgen import tokenizer as tokenizer_module
from tokenmill.textgen.tokenizer import Tokenizer

PRESETS = ("tiny-dense", "tiny-moe", "tiny-llama")
TEXTS = (
    "Hello world",
    "",
    "  leading, trailing and  double  spaces  ",
    "naïve café — 世界 🙂🎉 Ünïcödé\u00a0nbsp",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>text<|endoftext|> <|im_end|>x",
    "tabs\tand\nnewlines\r\n\n",
    "a <tool_call> b <|image|> c <|im_start|> d",
    "The quick brown fox. " * 40,
)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Quelle heure est-il? 世界 🙂"},
    {"role": "assistant", "content": "Il est midi."},
    {"role": "user", "content": "Et demain?"},
]

# Exercises what transformers' environment adds: trim/lstrip_blocks, loopcontrols, namespace,
# dict, tojson options, {% generation %}, raise_exception, strftime_now, special-token variables,
# tools/documents/extra kwargs, dropped None keys and reasoning aliases.
RICH_TEMPLATE = """{{- bos_token -}}
{%- set ns = namespace(turns=0) -%}
{% if tools %}
TOOLS {{ tools | tojson(indent=2, sort_keys=True) }}
{% endif %}
{% for doc in documents or [] %}
DOC {{ doc.title }}: {{ doc.text }}
{% endfor %}
{% for message in messages %}
    {% if message.role == 'system' and not loop.first %}
        {{ raise_exception('the system message must come first') }}
    {% endif %}
    {% if message.role == 'skip' %}{% continue %}{% endif %}
    {% if message.role == 'stop' %}{% break %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
{% if message.thinking is defined %}[{{ message.thinking | length }}]{% endif %}
{% if message.role == 'assistant' %}{% generation %}{{ message.content if message.content is defined else '(none)' }}{% endgeneration %}
{% else %}{{ message.content if message.content is defined else '(none)' }}
{% endif %}
{% if message.tool_calls is defined %}CALLS {{ message.tool_calls | tojson }}{% endif %}
<|im_end|>
{% endfor %}
{% set d = dict(a=1, b='ü') %}
turns={{ ns.turns }} {{ d | tojson(separators=(',', ':')) }} year={{ strftime_now('%Y') | length }} pad={{ pad_token }}
{% if enable_thinking is defined and not enable_thinking %}
NO_THINK
{% endif %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""
RICH_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Quelle heure? <b>&</b> 世界 🙂", "name": None},
    {"role": "assistant", "content": None, "reasoning": "the user wants the time",
     "tool_calls": [{"type": "function", "function": {"name": "now", "arguments": {"tz": "UTC", "é": 1}}}]},
    {"role": "tool", "content": "12:00"},
    {"role": "skip", "content": "hidden"},
    {"role": "assistant", "content": "Il est midi."},
    {"role": "stop", "content": "x"},
    {"role": "user", "content": "never rendered"},
]
TOOLS = [{"type": "function", "function": {"name": "now", "description": "Current time, ünïcode",
                                           "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}]
DOCUMENTS = [{"title": "Doc", "text": "Body ü"}]


@dataclass
class Message:
    role: str
    content: str | None


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> Callable[[Path], Any]:
    cache: dict[Path, Any] = {}

    def load(model_dir: Path) -> Any:
        if model_dir not in cache:
            cache[model_dir] = AutoTokenizer.from_pretrained(str(model_dir))
        return cache[model_dir]
    return load


def copy_checkpoint(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """The tokenizer files of `src` in `dst` (no weights), tokenizer_config edited by `edit`."""
    dst.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    if edit is not None:
        edit_json(dst / "tokenizer_config.json", edit)
    return dst


def edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, ensure_ascii=False))


def reference_chat_ids(ref: Any, messages: Any, **kwargs: Any) -> list[int]:
    return ref.encode(ref.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)


def assert_matches_reference(tok: Tokenizer, ref: Any) -> None:
    """Everything Tokenizer exposes equals the reference, for the standard texts and conversation."""
    for text in TEXTS:
        for add_special in (True, False):
            assert tok.encode(text, add_special_tokens=add_special) == ref.encode(text, add_special_tokens=add_special)
    ids = [i for text in TEXTS for i in ref.encode(text)] + [0, 1, 2, tok.vocab_size - 1]
    for cut in (len(ids), 7, 3, 1, 0):  # also prefixes that end inside a multi-byte character
        for skip in (True, False):
            assert tok.decode(ids[:cut], skip_special_tokens=skip) == ref.decode(ids[:cut], skip_special_tokens=skip)
    assert tok.special_token_ids == frozenset(ref.all_special_ids)
    assert tok.vocab_size == len(ref)
    if getattr(ref, "chat_template", None):
        for gen in (True, False):
            assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=gen) == reference_chat_ids(
                ref, CONVERSATION, add_generation_prompt=gen)


@pytest.mark.parametrize("preset", PRESETS)
def test_test_checkpoints_load_through_tokenizers_and_match_transformers(
        model_dirs: dict[str, Path], reference: Callable[[Path], Any], preset: str) -> None:
    tok, ref = Tokenizer(model_dirs[preset]), reference(model_dirs[preset])
    assert tok.backend == "tokenizers"
    assert_matches_reference(tok, ref)
    generation = json.loads((model_dirs[preset] / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    assert tok.eos_token_ids == {ref.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    assert tok.decode(tok.encode(TEXTS[3])) == TEXTS[3]


@pytest.mark.parametrize("preset", PRESETS)
def test_chat_ids_equal_transformers_tokenizing_the_chat_itself(
        model_dirs: dict[str, Path], reference: Callable[[Path], Any], preset: str) -> None:
    tok, ref = Tokenizer(model_dirs[preset]), reference(model_dirs[preset])
    for gen in (True, False):
        expected = ref.apply_chat_template(CONVERSATION, add_generation_prompt=gen, tokenize=True, return_dict=False)
        assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=gen) == list(expected)


def test_a_fresh_process_loads_and_uses_the_tokenizer_without_transformers_or_torch(tiny_dense: Path) -> None:
    code = (
        "import sys; from tokenmill.textgen.tokenizer import Tokenizer; "
        f"t = Tokenizer({str(tiny_dense)!r}); assert t.backend == 'tokenizers', t.backend; "
        "ids = t.apply_chat_template([{'role': 'user', 'content': 'hi'}]); t.decode(t.encode('hé') + ids); "
        "bad = [m for m in ('transformers', 'torch') if m in sys.modules]; assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def rich_checkpoint(src: Path, dst: Path) -> Path:
    """A checkpoint whose templates come from files: chat_template.jinja and a tool_use template."""
    copy_checkpoint(src, dst, lambda cfg: cfg.update(chat_template="IGNORED: template files take priority"))
    (dst / "chat_template.jinja").write_text(RICH_TEMPLATE, encoding="utf-8")
    (dst / "additional_chat_templates").mkdir()
    (dst / "additional_chat_templates" / "tool_use.jinja").write_text("TOOL_USE " + RICH_TEMPLATE, encoding="utf-8")
    return dst


@pytest.mark.parametrize("kwargs", [
    {},
    {"add_generation_prompt": False},
    {"tools": TOOLS},
    {"documents": DOCUMENTS, "enable_thinking": False},
    {"chat_template": "default", "bos_token": "BOS-OVERRIDE"},
    {"chat_template": "{% for m in messages %}{{ m.role }}|{{ m.content | default('-') }};{% endfor %}"},
], ids=["plain", "no-generation-prompt", "tools", "documents-kwargs", "named-override", "inline-template"])
def test_template_engine_matches_transformers(tiny_dense: Path, tmp_path: Path, kwargs: dict[str, Any]) -> None:
    model_dir = rich_checkpoint(tiny_dense, tmp_path / "rich")
    tok, ref = Tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.backend == "tokenizers"
    kwargs = {"add_generation_prompt": True, **kwargs}
    assert tok.apply_chat_template(RICH_MESSAGES, **kwargs) == reference_chat_ids(ref, RICH_MESSAGES, **kwargs)


def test_message_objects_and_continued_final_messages_match_transformers(tiny_dense: Path, tmp_path: Path) -> None:
    model_dir = rich_checkpoint(tiny_dense, tmp_path / "rich")
    tok, ref = Tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    objects = [Message("user", "hi"), Message("assistant", None), Message("user", "again")]
    assert tok.apply_chat_template(objects) == reference_chat_ids(ref, objects, add_generation_prompt=True)
    partial = [*CONVERSATION, {"role": "assistant", "content": "Demain il sera "}]
    for field in (True, "content"):
        expected = reference_chat_ids(ref, partial, add_generation_prompt=False, continue_final_message=field)
        assert tok.apply_chat_template(partial, add_generation_prompt=False, continue_final_message=field) == expected
    with pytest.raises(ValueError):
        tok.apply_chat_template(partial, add_generation_prompt=True, continue_final_message=True)


def test_named_templates_in_tokenizer_config_match_transformers(tiny_dense: Path, tmp_path: Path) -> None:
    templates = [{"name": "default", "template": RICH_TEMPLATE}, {"name": "short", "template": "{{ messages | length }}"}]
    model_dir = copy_checkpoint(tiny_dense, tmp_path / "named", lambda cfg: cfg.update(chat_template=templates))
    tok, ref = Tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    for kwargs in ({}, {"chat_template": "short"}):
        assert tok.apply_chat_template(CONVERSATION, **kwargs) == reference_chat_ids(
            ref, CONVERSATION, add_generation_prompt=True, **kwargs)


def test_raise_exception_in_a_template_is_a_value_error(tiny_dense: Path, tmp_path: Path) -> None:
    model_dir = rich_checkpoint(tiny_dense, tmp_path / "rich")
    late_system = [CONVERSATION[1], CONVERSATION[0]]
    with pytest.raises(jinja2.TemplateError, match="must come first"):  # what transformers does
        AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(late_system, tokenize=False)
    with pytest.raises(ValueError, match="must come first"):
        Tokenizer(model_dir).apply_chat_template(late_system)
    with pytest.raises(ValueError):  # a syntax error too
        Tokenizer(model_dir).apply_chat_template(CONVERSATION, chat_template="{% if %}")


def test_no_chat_template_is_a_value_error(tiny_dense: Path, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_dense, tmp_path / "plain", lambda cfg: cfg.pop("chat_template"))
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer(model_dir).apply_chat_template(CONVERSATION)


def extra_tokens(split: bool) -> Callable[[dict[str, Any]], None]:
    """New added tokens (one special, named by a model-specific key), an existing token re-flagged
    (lstrip), extra special tokens, an AddedToken-dict eos, and split_special_tokens."""
    def edit(cfg: dict[str, Any]) -> None:
        flags = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
        cfg["added_tokens_decoder"]["1"]["lstrip"] = True
        cfg["added_tokens_decoder"]["5000"] = {"content": "<tool_call>", **flags, "special": False}
        cfg["added_tokens_decoder"]["5001"] = {"content": "<|image|>", **flags, "special": True}
        cfg["image_token"] = "<|image|>"
        cfg["additional_special_tokens"] = ["<|im_start|>"]
        cfg["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", **flags, "special": True}
        cfg["split_special_tokens"] = split
    return edit


@pytest.mark.parametrize("split", [False, True], ids=["specials-kept", "split-special-tokens"])
def test_tokenizer_config_tokens_are_applied_as_transformers_applies_them(
        tiny_dense: Path, tmp_path: Path, split: bool) -> None:
    model_dir = copy_checkpoint(tiny_dense, tmp_path / "extra", extra_tokens(split))
    tok, ref = Tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.backend == "tokenizers"
    assert_matches_reference(tok, ref)
    assert tok.vocab_size == 2050 and {1, 2049} <= tok.special_token_ids
    assert tok.eos_token_ids == {ref.eos_token_id, 0}


def gpt2_files_only(model_dir: Path) -> None:
    """vocab.json + merges.txt instead of tokenizer.json, as GPT-2-era checkpoints ship."""
    import tokenizers

    tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json")).model.save(str(model_dir))
    (model_dir / "tokenizer.json").unlink()
    edit_json(model_dir / "tokenizer_config.json", lambda cfg: cfg.update(tokenizer_class="GPT2Tokenizer"))


FALLBACKS: dict[str, Callable[[Path], None]] = {
    "no-tokenizer-json": gpt2_files_only,
    "clean-up-spaces": lambda d: edit_json(d / "tokenizer_config.json",
                                           lambda c: c.update(clean_up_tokenization_spaces=True)),
    "add-bos-token": lambda d: edit_json(d / "tokenizer_config.json", lambda c: c.update(add_bos_token=True)),
    "model-tokenizer-class": lambda d: edit_json(d / "tokenizer_config.json",
                                                 lambda c: c.update(tokenizer_class="Qwen2Tokenizer")),
    "class-overridden-model-type": lambda d: edit_json(d / "config.json", lambda c: c.update(model_type="qwen2")),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_checkpoints_only_transformers_reproduces_load_through_it(tiny_dense: Path, tmp_path: Path, name: str) -> None:
    model_dir = copy_checkpoint(tiny_dense, tmp_path / name)
    FALLBACKS[name](model_dir)
    tok, ref = Tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.backend == "transformers"
    assert_matches_reference(tok, ref)
    assert tok.eos_token_ids == {2, 0}


def test_the_class_override_list_covers_the_installed_transformers() -> None:
    from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

    assert set(MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) <= tokenizer_module._CLASS_OVERRIDE_MODEL_TYPES


def test_hf_stays_available(tiny_dense: Path) -> None:
    tok = Tokenizer(tiny_dense)
    assert tok.hf.encode("Hello world") == tok.encode("Hello world")
    assert tok.backend == "tokenizers"


def test_a_missing_or_broken_tokenizer_is_a_value_error(tiny_dense: Path, tmp_path: Path) -> None:
    broken = copy_checkpoint(tiny_dense, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    for model_dir in (broken, tmp_path / "missing"):
        with pytest.raises(ValueError, match="cannot load the tokenizer"):
            Tokenizer(model_dir)
