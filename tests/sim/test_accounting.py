"""Parameter and KV accounting against published figures, within 1%."""
import pytest

from tokenmill.sim.accounting import active_params, kv_bytes_per_token, total_params
from tokenmill.sim.models import from_hf_config, get_model
from tokenmill.sim.validate import accounting_cases


@pytest.mark.parametrize("case", accounting_cases(), ids=lambda c: c.name)
def test_accounting_within_tolerance(case):
    assert case.passed, f"{case.name}: {case.value} vs {case.target}"


def test_qwen3_30b_a3b_totals_match_its_card_under_the_both_embeddings_convention():
    m = get_model("qwen3-30b-a3b")
    embeddings = 2 * m.vocab * m.hidden
    assert total_params(m) / 1e9 == pytest.approx(30.5, abs=0.05)
    assert (total_params(m) - embeddings) / 1e9 == pytest.approx(29.9, abs=0.05)
    assert (active_params(m) - embeddings) / 1e9 == pytest.approx(2.73, abs=0.01)


def test_deepseek_v3_active_count_with_its_mtp_module():
    m = get_model("deepseek-r1")
    main = active_params(m, input_embedding=False) / 1e9
    with_mtp = active_params(m, input_embedding=False, mtp=True) / 1e9
    assert main == pytest.approx(36.63, abs=0.01)
    assert with_mtp - main == pytest.approx(0.688, abs=0.001)  # 2d^2 projection + one MoE block's active part
    assert total_params(m) / 1e9 == pytest.approx(671.0, abs=0.1)  # the card's main-model total excludes MTP


def test_deepseek_active_definition_fits_the_family():
    # Of the three readings, "LM head counted, input lookup not" is the closest to every published
    # DeepSeek figure: V2-Lite "2.4B", V2 "21B" (DeepSeek-V2 paper / model card), V3 "37B"
    # (DeepSeek-V2 paper / model card), shapes from their HF config.json.
    lite = dict(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, intermediate_size=10944,
                moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                first_k_dense_replace=1, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, vocab_size=102400)
    v2 = lite | dict(hidden_size=5120, num_hidden_layers=60, num_attention_heads=128, intermediate_size=12288,
                     moe_intermediate_size=1536, n_routed_experts=160, q_lora_rank=1536)
    for m, published in ((from_hf_config(lite, "v2-lite"), 2.4), (from_hf_config(v2, "v2"), 21.0),
                         (get_model("deepseek-r1"), 37.0)):
        lookup = m.vocab * m.hidden / 1e9
        counts = {"lookup excluded": active_params(m, input_embedding=False) / 1e9}
        counts |= {"both": counts["lookup excluded"] + lookup, "neither": counts["lookup excluded"] - lookup}
        assert min(counts, key=lambda k: abs(counts[k] - published)) == "lookup excluded", (published, counts)


def test_dense_models_are_fully_active():
    m = get_model("llama-3.1-405b")
    assert active_params(m) == total_params(m)
    assert total_params(m) / 1e9 == pytest.approx(405.9, rel=0.01)


def test_sliding_window_caps_gpt_oss_kv_at_long_context():
    m = get_model("gpt-oss-120b")
    short, long = kv_bytes_per_token(m, 2.0, 100), kv_bytes_per_token(m, 2.0, 8192)
    assert long < 0.6 * short  # half the layers stop growing past 128 tokens
