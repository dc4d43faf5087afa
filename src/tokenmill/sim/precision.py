"""Numeric formats: bytes per stored value and the tensor-core rate each one computes at."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Format:
    name: str
    bytes_per_value: float  # including block scales
    compute: str  # peak-rate key in GpuSpec.peak_flops


# NVFP4: 4-bit values plus one FP8 scale per 16 values -> 4.5 bits (NVIDIA NVFP4 blog).
# FP8 block scaling (one fp32 scale per 128x128 block) adds < 0.01% and is ignored.
FORMATS: dict[str, Format] = {
    "bf16": Format("bf16", 2.0, "bf16"),
    "fp16": Format("fp16", 2.0, "bf16"),
    "fp8": Format("fp8", 1.0, "fp8"),
    "fp4": Format("nvfp4", 0.5625, "fp4"),
    "int4": Format("int4", 0.5625, "fp8"),  # weight-only INT4 (group 32 scales), dequantised to FP8 math
    "fp32": Format("fp32", 4.0, "fp32"),
}
FORMAT_ALIASES: dict[str, str] = {"nvfp4": "fp4", "fp8_block": "fp8", "int4_wo": "int4", "": "bf16", "none": "bf16"}


def get_format(name: str) -> Format:
    key = FORMAT_ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise ValueError(f"precision {name!r} not one of {sorted(FORMATS) + sorted(FORMAT_ALIASES)}")
    return FORMATS[key]


@dataclass(slots=True, frozen=True)
class PrecisionPlan:
    """Formats for weights, activations (GEMM inputs), the KV cache and the attention projections."""

    weights: Format
    activations: Format
    kv: Format
    attention: Format | None = None  # attention projection weights; None: same as `weights`

    @property
    def attention_weights(self) -> Format:
        return self.attention or self.weights

    @classmethod
    def named(cls, precision: str, kv: str | None = None, moe: bool = False) -> "PrecisionPlan":
        """`fp8` -> FP8 weights, activations and KV; `fp4` -> NVFP4 GEMMs with FP8 KV; `bf16` everything.

        4-bit MoE checkpoints quantize the experts only (`moe=True`): NVIDIA's DeepSeek-R1-FP4 keeps
        the attention modules out of NVFP4 (TensorRT-LLM tech blog 1, precision table: attention bf16),
        as do gpt-oss (MXFP4 experts) and Kimi-K2 (INT4 experts). The engines then run attention in
        FP8 alongside an FP8 KV cache (tech blog 3: "FP8 KV cache and FP8 attention"), else BF16.
        Dense 4-bit checkpoints quantize every linear layer, attention included.
        """
        weights = get_format(precision)
        acts = weights if weights.name != "int4" else FORMATS["fp8"]
        kv_default = "bf16" if weights.name in ("bf16", "fp16", "fp32") else "fp8"
        kv_format = get_format(kv or kv_default)
        attention = None
        if moe and weights.bytes_per_value < 1.0:
            attention = FORMATS["fp8"] if kv_format.bytes_per_value <= 1.0 else FORMATS["bf16"]
        return cls(weights=weights, activations=acts, kv=kv_format, attention=attention)
