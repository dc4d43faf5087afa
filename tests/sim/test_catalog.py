"""GPU and model catalogs: sources present, lookups, HF config parsing, validation errors."""
import dataclasses
import json

import pytest

from tokenmill.sim.hardware import GpuSpec, builtin_gpus, get_gpu
from tokenmill.sim.models import builtin_model_names, from_hf_config, get_model
from tokenmill.sim.precision import PrecisionPlan, get_format

NUMERIC_FIELDS = [f.name for f in dataclasses.fields(GpuSpec) if f.name not in ("name", "display_name", "sources")]


def test_catalog_has_the_six_gpus_with_a_source_for_every_number():
    gpus = builtin_gpus()
    assert set(gpus) == {"h100", "h200", "b200", "b300", "gb200", "gb300"}
    for spec in gpus.values():
        missing = [f for f in NUMERIC_FIELDS if not spec.sources.get(f)]
        assert missing == [], f"{spec.name} lacks sources for {missing}"


def test_nvl72_racks_have_72_gpu_domains_and_hgx_has_8():
    assert get_gpu("gb200").domain_size == 72 and get_gpu("gb300").domain_size == 72
    assert get_gpu("b200_sxm").domain_size == 8 and get_gpu("h100").domain_size == 8


def test_fp4_is_faster_than_fp8_on_blackwell_only():
    assert get_gpu("b200").peak_flops("fp4") == 2 * get_gpu("b200").peak_flops("fp8")
    assert get_gpu("h100").peak_flops("fp4") == get_gpu("h100").peak_flops("fp8")


def test_unknown_gpu_and_bad_fields_raise_value_error():
    with pytest.raises(ValueError, match="not in catalog"):
        get_gpu("tpu-v9")
    with pytest.raises(ValueError, match="mem_eff"):
        get_gpu("h100").with_overrides(mem_eff=1.5)


def test_all_builtin_models_load():
    names = builtin_model_names()
    for required in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "qwen3-32b", "qwen3-30b-a3b",
                     "qwen3-235b-a22b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-120b"):
        assert required in names
    assert get_model("deepseek-r1").name == "deepseek-v3"


def test_deepseek_shape_matches_the_issue():
    m = get_model("deepseek-r1")
    assert m.is_mla and m.kv_lora_rank + m.qk_rope_dim == 576
    assert (m.dense_layers, m.moe_layers, m.experts, m.top_k, m.shared_experts) == (3, 58, 256, 8, 1)


def test_model_from_any_config_json_path(tmp_path):
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = get_model(str(tmp_path))
    assert (m.head_dim, m.experts, m.expert_ffn, m.moe_layers) == (16, 8, 32, 2)


def test_model_validation_names_the_field():
    with pytest.raises(ValueError, match="top_k"):
        from_hf_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 10,
                        "num_experts": 2, "num_experts_per_tok": 3}, "bad")
    with pytest.raises(ValueError, match="not a config.json"):
        get_model("no-such-model")


def test_precision_plans():
    assert get_format("nvfp4").bytes_per_value == pytest.approx(0.5625)
    plan = PrecisionPlan.named("fp4")
    assert (plan.weights.compute, plan.kv.name) == ("fp4", "fp8")
    assert PrecisionPlan.named("bf16").kv.bytes_per_value == 2.0
    with pytest.raises(ValueError, match="precision"):
        get_format("fp3")
