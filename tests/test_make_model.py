"""`tokenmill make-model`: checkpoints transformers loads, a real BPE, ChatML, determinism."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tokenmill import cli
from tokenmill.engine import presets
from tokenmill.engine.make_model import write_model
from tokenmill.textgen.bpe_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

TINY = ("tiny-dense", "tiny-llama", "tiny-moe")
ARCH = {"tiny-dense": "Qwen3ForCausalLM", "tiny-llama": "LlamaForCausalLM", "tiny-moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: write_model(name, tmp_path_factory.mktemp(name)) for name in TINY}


def _keys_on_disk(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as handle:
        return set(handle.keys())


def _load(path: Path) -> tuple[torch.nn.Module, dict]:
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    return model.eval(), info


@pytest.mark.parametrize("name", TINY)
def test_transformers_loads_tiny_preset_without_missing_keys(checkpoints: dict[str, Path], name: str) -> None:
    model, info = _load(checkpoints[name])
    assert type(model).__name__ == ARCH[name]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.tensor([[5, 17, 300, 1200, 9]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, 2048)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", TINY)
def test_files_hold_exactly_the_hf_names(checkpoints: dict[str, Path], name: str) -> None:
    config = json.loads((checkpoints[name] / "config.json").read_text())
    keys = _keys_on_disk(checkpoints[name] / "model.safetensors")
    assert keys == set(presets.parameter_shapes(config))
    assert ("lm_head.weight" in keys) == (name != "tiny-dense")  # tied ⇒ no lm_head on disk
    if name == "tiny-moe":
        assert "model.layers.1.mlp.experts.7.gate_proj.weight" in keys
        assert "model.layers.0.mlp.gate.weight" in keys
    if name == "tiny-llama":
        assert "model.layers.0.self_attn.o_proj.bias" in keys


def test_transformers_fuses_our_experts_gate_then_up(checkpoints: dict[str, Path]) -> None:
    model, _ = _load(checkpoints["tiny-moe"])
    experts = model.model.layers[1].mlp.experts
    with safe_open(str(checkpoints["tiny-moe"] / "model.safetensors"), framework="pt") as handle:
        gate = handle.get_tensor("model.layers.1.mlp.experts.3.gate_proj.weight")
        up = handle.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight")
        down = handle.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight")
    assert torch.equal(experts.gate_up_proj[3], torch.cat([gate, up], dim=0))
    assert torch.equal(experts.down_proj[3], down)


@pytest.mark.parametrize("name", [*TINY, "small-moe", "llama-1b"])
def test_transformers_counts_the_same_parameters(name: str) -> None:
    config = presets.PRESETS[name].hf_config("float32")
    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in model.parameters()) == presets.parameter_count(config)


def test_small_moe_size_and_dtype() -> None:
    preset = presets.get_preset("small-moe")
    assert 50_000_000 <= presets.parameter_count(preset.config) <= 150_000_000
    assert preset.default_dtype == "bfloat16" and preset.config["vocab_size"] == 8192


@pytest.mark.parametrize("name", TINY)
def test_logits_are_spread_for_stable_greedy_comparisons(checkpoints: dict[str, Path], name: str) -> None:
    model, _ = _load(checkpoints[name])
    ids = torch.randint(3, 2048, (4, 48), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(ids).logits
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert logits.std(dim=-1).mean() > 3.0
    assert gaps.median() > 0.3
    assert (logits.argmax(-1) == ids).float().mean() < 0.05  # tied model must not echo its input


def test_greedy_text_is_varied(checkpoints: dict[str, Path]) -> None:
    model, _ = _load(checkpoints["tiny-moe"])
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["tiny-moe"])
    ids = tokenizer("Captain Wentworth said nothing, but", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert len(set(out[0, ids.shape[1]:].tolist())) > 8


def test_bpe_round_trips_multibyte_text(checkpoints: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["tiny-dense"])
    text = "Café naïve — Ünïcödé e\u0301 😀🚀 日本語のテキスト 中文, tabs\tand  spaces\n\nend "
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < 2048 for i in ids) and len(tokenizer) == 2048
    # A real BPE: common English words are single tokens, so prose takes far fewer tokens than bytes.
    prose = "She had been forced into prudence in her youth, she learned romance as she grew older."
    assert len(tokenizer.encode(prose)) < len(prose.encode()) / 2.5


def test_special_tokens_and_ids(checkpoints: dict[str, Path]) -> None:
    out = checkpoints["tiny-moe"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 2, 0)
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tokenizer.encode("hi")[0] != 0  # no BOS prepended
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 2, 0)
    assert generation["eos_token_id"] == [2, 0]


def test_chat_template_is_chatml(checkpoints: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["tiny-dense"])
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n"


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    first = write_model("tiny-moe", tmp_path / "a", seed=3)
    again = write_model("tiny-moe", tmp_path / "b", seed=3)
    other = write_model("tiny-moe", tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes()
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_sharded_checkpoint_loads_and_matches_single_file(tmp_path: Path) -> None:
    single = write_model("tiny-llama", tmp_path / "single", seed=1)
    sharded = write_model("tiny-llama", tmp_path / "sharded", seed=1, max_shard_mb=1)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_names = sorted(set(index["weight_map"].values()))
    assert len(shard_names) >= 2 and not (sharded / "model.safetensors").exists()
    assert set(index["weight_map"]) == _keys_on_disk(single / "model.safetensors")
    assert index["metadata"]["total_size"] == sum(4 * n for n in _shape_sizes(single))
    model, info = _load(sharded)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    reference, _ = _load(single)
    ids = torch.tensor([[40, 41, 42, 43]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def _shape_sizes(path: Path) -> list[int]:
    config = json.loads((path / "config.json").read_text())
    return [int(torch.Size(shape).numel()) for shape in presets.parameter_shapes(config).values()]


def test_bfloat16_option(tmp_path: Path) -> None:
    out = write_model("tiny-dense", tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert handle.metadata() == {"format": "pt"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_bad_input_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset"):
        write_model("huge-dense", tmp_path / "x")
    with pytest.raises(ValueError, match="dtype"):
        write_model("tiny-dense", tmp_path / "x", dtype="float16")
    with pytest.raises(ValueError, match="seed"):
        write_model("tiny-dense", tmp_path / "x", seed=-1)
    with pytest.raises(ValueError, match="max_shard_mb"):
        write_model("tiny-dense", tmp_path / "x", max_shard_mb=0)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="out"):
        write_model("tiny-dense", tmp_path / "full")


def test_force_replaces_a_sharded_checkpoint_and_keeps_other_files(tmp_path: Path) -> None:
    out = write_model("tiny-llama", tmp_path / "m", max_shard_mb=1)
    (out / "notes.txt").write_text("mine")
    write_model("tiny-dense", out, force=True)
    assert not list(out.glob("model-*-of-*.safetensors"))
    assert not (out / "model.safetensors.index.json").exists()
    assert (out / "notes.txt").read_text() == "mine"
    model, info = _load(out)
    assert type(model).__name__ == "Qwen3ForCausalLM" and not info["missing_keys"]


def test_cli_writes_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    code = cli.main(["make-model", "--preset", "tiny-moe", "--out", str(out), "--seed", "5"])
    assert code == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (out / "model.safetensors").read_bytes() == (write_model("tiny-moe", tmp_path / "api", seed=5)
                                                        / "model.safetensors").read_bytes()
