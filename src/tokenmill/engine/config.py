"""Engine configuration: every knob a worker passes through to its engine."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.engine.cpu_features import DtypeChoice, choose_auto_dtype, memory_bytes
from tokenmill.engine.device import DEVICES, resolve_device
from tokenmill.engine.mock_runner import StepTimeModel
from tokenmill.engine.speculative import SpeculativeConfig, check_draft_model
from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE
from tokenmill.step_work import StepClock
from tokenmill.textgen.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

# dtype name -> bytes per element; torch is imported only where tensors are made, so a
# mock worker (no weights, no forward pass) never loads it
DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_KV_CACHE_GB = 1.0
# The pool's size where no flag gives it, for every worker of a host (as vLLM's CPU backend reads
# VLLM_CPU_KVCACHE_SPACE). A worker zeroes its whole pool as it starts: each GiB is a GiB of first
# page faults (0.1-7 s of system time on a virtual machine whose host backs memory lazily).
KV_CACHE_GB_ENV = "TOKENMILL_KV_CACHE_GB"


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # "auto": the checkpoint's dtype
    threads: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None  # wins over kv_cache_gb
    kv_cache_gb: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    runner: str = "torch"  # or "mock"
    # the mock runner's clock: anything with seconds(StepWork) (the linear model, or the
    # simulator's StepClock that a worker builds for --mock-profile)
    mock_step_time: StepClock = field(default_factory=StepTimeModel)
    mock_sleep: bool = True
    mock_speedup: float = 1.0  # the mock runner waits modelled seconds / mock_speedup
    seed: int = 0
    tp: int = 1  # tensor-parallel ranks (processes) of this worker
    ep: int = 1  # expert-parallel ranks: the same group as tp when both are > 1
    # attention data-parallel ranks (== ep): each schedules its own requests on its own KV pool
    # of `kv_blocks` blocks, and the MoE layers exchange tokens between them (wide EP)
    attention_dp: int = 1
    # a worker process exits when a rank is lost (its supervisor restarts it whole, its requests
    # migrate); an embedded engine raises from step() instead
    exit_on_rank_loss: bool = False
    worker_id: str = "worker-0"
    hash_seed: int = 0
    # KV tiers below the device pool (engine/kv_tiers_wiring.py); all off by default
    kv_host_gb: float | None = None
    kv_disk_dir: str | None = None
    kv_disk_gb: float | None = None  # default 4 GiB when kv_disk_dir is set
    kv_shared: str | None = None  # redis://host:port/db or a shared directory
    kv_shared_gb: float | None = None  # default 1 GiB when kv_shared is set
    kv_write_through: bool = False
    kv_pin_file: str | None = None  # JSON lines: a prompt string or a list of token ids
    speculative: SpeculativeConfig | None = None  # draft tokens each decode step verifies (torch runner)
    device: str = "cpu"  # the torch runner's: cpu or cuda (auto is resolved to one of them here)
    enforce_eager: bool = False  # on a GPU, no CUDA graphs: every decode step launched op by op
    # batch-invariant kernels: a request's logits are the same bits whatever else is in its steps
    deterministic: bool = False

    @property
    def rank_threads(self) -> int | None:
        """`threads` shared out between a parallel worker's ranks (None: the default)."""
        return None if self.threads is None else max(1, self.threads // max(self.tp, self.ep, self.attention_dp))

    @property
    def kv_tiers_enabled(self) -> bool:
        return bool(self.kv_host_gb or self.kv_disk_dir or self.kv_shared)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.runner not in ("torch", "mock"):
            raise ValueError(f"runner must be 'torch' or 'mock', got {self.runner!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if self.num_kv_blocks is None and self.kv_cache_gb is None:
            default_kv_cache_gb()  # a bad $TOKENMILL_KV_CACHE_GB is named before any pool is made
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if not (isinstance(self.mock_speedup, (int, float)) and math.isfinite(self.mock_speedup)
                and self.mock_speedup > 0):
            raise ValueError(f"mock_speedup must be a finite number > 0, got {self.mock_speedup!r}")
        if not callable(getattr(self.mock_step_time, "seconds", None)):
            raise ValueError("mock_step_time must have a seconds(StepWork) method")
        self._validate_tiers()
        self._validate_speculative()
        self._validate_device()

    def _validate_device(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cpu":
            return
        if self.runner != "torch":
            raise ValueError(f"--device {self.device}: the mock runner computes nothing; use --device cpu")
        self.device = resolve_device(self.device)  # imports torch: only for a device other than the CPU
        if self.device == "cpu":  # auto, without a GPU
            return
        if self.deterministic:
            raise ValueError(f"--device {self.device}: --deterministic needs the native CPU kernels; "
                             "PyTorch's GPU kernels change their reductions with the batch")
        if self.tp != 1 or self.ep != 1 or self.attention_dp != 1:
            raise ValueError(f"--device {self.device}: --tp, --ep and --attention-dp run on the CPU only for now")
        if self.kv_tiers_enabled:
            raise ValueError(f"--device {self.device}: the KV tiers copy from a host-memory pool; not with a GPU yet")

    def _validate_speculative(self) -> None:
        if self.speculative is None:
            return
        if self.runner != "torch":
            raise ValueError("--speculative needs --runner torch: the mock runner's tokens are a hash of the "
                             "sequence, so drafts would verify nothing")
        if self.speculative.draft_model is not None:
            check_draft_model(self.model, self.speculative.draft_model)

    def _validate_tiers(self) -> None:
        for name in ("kv_host_gb", "kv_disk_gb", "kv_shared_gb"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        needs = (("kv_disk_gb", "kv_disk_dir"), ("kv_shared_gb", "kv_shared"), ("kv_write_through", "kv_shared"))
        for name, other in needs:
            if getattr(self, name) and not getattr(self, other):
                raise ValueError(f"{name} needs {other}")
        if self.kv_pin_file is not None and not self.kv_tiers_enabled:
            raise ValueError("kv_pin_file needs a KV tier (kv_host_gb, kv_disk_dir or kv_shared)")
        if self.kv_tiers_enabled and self.runner != "torch":
            raise ValueError("KV tiers (kv_host_gb, kv_disk_dir, kv_shared) need runner 'torch': "
                             "the mock runner holds no KV to offload")

    def dtype_name(self, model_cfg: ModelConfig) -> str:
        return self.dtype_choice(model_cfg).dtype

    def dtype_choice(self, model_cfg: ModelConfig) -> DtypeChoice:
        """The dtype weights and KV run in: the flag's; for `auto` the checkpoint's, except that the
        torch runner takes fp32 on a CPU without instructions for the checkpoint's (and says why)."""
        if self.dtype != "auto":
            return DtypeChoice(self.dtype)
        name = model_cfg.checkpoint_dtype if model_cfg.checkpoint_dtype in DTYPES else "float32"
        if self.runner != "torch" or name == "float32" or self.device != "cpu":
            return DtypeChoice(name)
        return choose_auto_dtype(name, _fp32_weight_bytes(self.model, DTYPES[name]), memory_bytes())

    def torch_dtype(self, model_cfg: ModelConfig) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name(model_cfg))

    def kv_blocks(self, model_cfg: ModelConfig) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        gb = self.kv_cache_gb if self.kv_cache_gb is not None else default_kv_cache_gb()
        itemsize = DTYPES[self.dtype_name(model_cfg)]
        per_block = 2 * model_cfg.num_layers * self.block_size * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize
        return max(1, int(gb * 2**30) // per_block)


def default_kv_cache_gb() -> float:
    """$TOKENMILL_KV_CACHE_GB where it is set (GiB, > 0), else DEFAULT_KV_CACHE_GB."""
    raw = os.environ.get(KV_CACHE_GB_ENV)
    if raw is None:
        return DEFAULT_KV_CACHE_GB
    try:
        gb = float(raw)
    except ValueError:
        gb = math.nan
    if not (math.isfinite(gb) and gb > 0):
        raise ValueError(f"{KV_CACHE_GB_ENV} must be a positive number of GiB, got {raw!r}")
    return gb


@cache
def _fp32_weight_bytes(model: str, itemsize: int) -> int:
    """The checkpoint's weights in fp32: its safetensors files, widened from `itemsize` bytes."""
    return sum(path.stat().st_size for path in Path(model).glob("*.safetensors")) * 4 // itemsize
