"""`tokenmill generate`: stream text from the embedded engine, one-shot or interactively.

With `--prompt` it answers once; otherwise it reads one prompt per line from
standard input until end of input. `--chat` wraps each prompt as a user message
through the checkpoint's chat template.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (HF format)")
    parser.add_argument("--prompt", help="answer this prompt and exit (default: read lines from stdin)")
    parser.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.textgen.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, threads=args.threads))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = [args.prompt] if args.prompt is not None else _stdin_prompts()
    for i, text in enumerate(prompts):
        try:
            _answer(engine, f"cli-{i}", text, params, args.chat)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
    return 0


def _stdin_prompts():
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _answer(engine, request_id: str, text: str, params, chat: bool) -> None:
    tokenizer = engine.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}]) if chat else tokenizer.encode(text)
    engine.add_request(request_id, ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
    print()
