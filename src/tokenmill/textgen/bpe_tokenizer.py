"""A real byte-level BPE tokenizer, trained offline on public-domain prose shipped in the package.

Layout follows GPT-2/Qwen conventions so that transformers' `AutoTokenizer` and our own frontend
read it like any downloaded checkpoint: `tokenizer.json` (the `tokenizers` model) and
`tokenizer_config.json` (special tokens, `model_max_length`, a ChatML `chat_template`).

Training is deterministic: `tokenizers`' BPE trainer breaks ties by pair order, and the corpus
and its paragraph order are fixed, so the same vocab size gives byte-identical files.
"""
from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# Their order fixes their ids: <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN = "<|endoftext|>"  # never added automatically (no post-processor template), as in Qwen
EOS_TOKEN = "<|im_end|>"  # ends an assistant turn; <|endoftext|> also stops generation
PAD_TOKEN = "<|endoftext|>"
CORPUS_PACKAGE = "tokenmill.textgen.corpus"
CORPUS_FILES: tuple[str, ...] = ("persuasion.txt",)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte must stay representable

# ChatML, with tools as Qwen 2.5 shows them: a system block listing them in <tools></tools>,
# an assistant's calls as <tool_call> JSON, tool results as <tool_response> in a user turn.
# Content may be a string, None (an assistant turn that only calls tools) or a list of
# OpenAI-style parts, whose text parts are joined. Without tools the output is plain ChatML.
CHAT_TEMPLATE = (
    "{%- macro text(message) -%}"
    "{%- if message['content'] is none -%}{{- '' -}}"
    "{%- elif message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{{- message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -}}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- text(messages[0]) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + text(message) + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message) -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + call['function']['name'] + '\\\", \\\"arguments\\\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def corpus_paragraphs() -> Iterator[str]:
    """The training text, one paragraph at a time (BPE counts words per item anyway)."""
    root = resources.files(CORPUS_PACKAGE)
    for name in CORPUS_FILES:
        text = root.joinpath(name).read_text(encoding="utf-8")
        for paragraph in text.split("\n\n"):
            if paragraph.strip():
                yield paragraph + "\n\n"


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` entries, special tokens included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size: must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: text must round-trip byte for byte (NFC would rewrite decomposed accents).
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # min_frequency 1 lets the bigger vocabularies fill up from a single novel.
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so emoji, CJK and any other UTF-8 encode without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus_paragraphs(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size: the corpus only supports {tokenizer.get_vocab_size()} tokens, asked for {vocab_size}"
        )
    return tokenizer


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens, fixed by their position at the start of the vocabulary."""
    return {token: index for index, token in enumerate(SPECIAL_TOKENS)}


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """The tokenizer_config.json content."""
    added = {
        str(index): {"content": token, "lstrip": False, "rstrip": False, "normalized": False,
                     "single_word": False, "special": True}
        for token, index in special_token_ids().items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    """Train and write tokenizer.json and tokenizer_config.json into `out`."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    config_text = json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config_text + "\n", encoding="utf-8")
    log.debug("wrote a %d-token BPE tokenizer to %s", vocab_size, out)
