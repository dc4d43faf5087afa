"""Model runners: turn a scheduled step into sampled tokens.

The scheduler and KV cache are the same for every runner; only the forward pass
differs. `TorchModelRunner` runs the real model on the paged KV cache.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine import kernels
from tokenmill.engine.attention import AttentionBatch, DecodeBatch, SeqSpan, allocate_kv_cache
from tokenmill.engine.decode_graphs import DecodeGraphs, GraphShapes
from tokenmill.engine.guided import MaskComputer
from tokenmill.engine.kernels import grouped_experts, prefill_attention
from tokenmill.engine.models.transformer import CausalLM
from tokenmill.engine.runner_protocol import KVAllocator, Sampled
from tokenmill.engine.sampler import sample
from tokenmill.engine.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.kv.cache_manager import KVCacheManager
from tokenmill.textgen.model_config import ModelConfig
from tokenmill.textgen.sampling import SampleRow


@dataclass(slots=True)
class StepPart:
    """One sequence's rows in a step: tokens `ids` at positions start.., over its `blocks`."""
    ids: list[int]
    start: int
    blocks: np.ndarray  # int64, covering every position up to start + len(ids)
    # each row a lone query over the keys up to its own (a decode, its drafts): the native
    # decode kernel's, which reads their context once; otherwise one causal span
    single_queries: bool
    logits: int  # how many of its last rows give logits (0: none)


class TorchModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, seed: int = 0, kv_allocator: KVAllocator | None = None,
                 device: str = "cpu", graphs: GraphShapes | None = None, batch_invariant: bool = False) -> None:
        """On a `device` other than the CPU the model and the KV pool live there and the forward
        pass takes PyTorch's own ops (the native kernels are CPU code); steps are prepared and
        sampled on the host. With `graphs`, decode steps replay captured graphs (`DecodeGraphs`),
        and the pool holds one scratch block past `num_blocks` for their padding rows.
        `batch_invariant` (a model loaded so, on the CPU): decodes attend through the prefill
        kernel, so that a position's row is the same bits in a decode step as in a prompt chunk
        (a preempted request's recompute, a prefix computed by another worker)."""
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        pool_blocks = num_blocks + (graphs is not None)
        if kv_allocator is None:
            self.kv_cache = allocate_kv_cache(cfg.num_layers, pool_blocks, block_size,
                                              cfg.num_kv_heads, cfg.head_dim, dtype, device)
        else:
            shape = (cfg.num_layers, 2, pool_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
            self.kv_cache = kv_allocator(shape, dtype)
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab_size = cfg.vocab_size
        self.mask_computer: MaskComputer | None = None  # structured outputs' masks, beside the forward pass
        on_cpu = self.device.type == "cpu" and graphs is None
        self.native_prefill = self.device.type == "cpu" and prefill_attention.supported(dtype, cfg.head_dim)
        if batch_invariant and not (on_cpu and self.native_prefill and grouped_experts.available(dtype)):
            raise ValueError("--deterministic needs the native CPU kernels (a C compiler, AVX2 and FMA, head_dim a "
                             f"multiple of 16); they do not run here for {dtype} on {device}")
        self.native_decode = on_cpu and dtype in (torch.float32, torch.bfloat16) and not batch_invariant \
            and cfg.head_dim <= kernels.MAX_HEAD_DIM and kernels.available()
        # decodes in the row form, through PyTorch's ops: one batched call, not a span per sequence
        self.row_decode = not on_cpu
        self.graphs = None if graphs is None else DecodeGraphs(self.forward, graphs, num_blocks, block_size,
                                                               cfg.vocab_size, device)

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> Sampled:
        input_ids, positions, batch, logits_rows = self._prepare(out, kv)
        sampling = [s for s in out.seqs if s.samples]
        masks = self._start_masks(sampling)
        logits = None if self.graphs is None else self.graphs.run(input_ids, positions, batch, logits_rows)
        if logits is None:
            logits = self.forward(*self.to_device(input_ids, positions, batch, logits_rows))
        return self._sample(sampling, logits.cpu(), masks)

    def to_device(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                   logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]:
        """The step's host-built tensors where the model is (as they are on the CPU)."""
        if self.device.type == "cpu":
            return input_ids, positions, batch, logits_rows
        device = self.device
        spans = [SeqSpan(s.query_start, s.query_len, s.context_len, s.block_ids.to(device)) for s in batch.spans]
        d = batch.decode
        decode = None if d is None else DecodeBatch(d.rows.to(device), d.block_table.to(device),
                                                    d.context_lens.to(device), d.queries.to(device), d.native)
        moved = AttentionBatch(batch.slot_mapping.to(device), spans, decode, False)
        return input_ids.to(device), positions.to(device), moved, logits_rows.to(device)

    def _start_masks(self, sampling: list[ScheduledSeq]) -> tuple[list[int], Future[np.ndarray]] | None:
        """Structured outputs' token masks, computed beside the forward pass."""
        guided = [i for i, s in enumerate(sampling) if s.request.matcher is not None]
        if not guided:
            return None
        return guided, self._masks().start([sampling[i].request.matcher for i in guided])

    def _sample(self, sampling: list[ScheduledSeq], logits: torch.Tensor,
                masks: tuple[list[int], Future[np.ndarray]] | None) -> Sampled:
        """The tokens of each of `sampling` from its rows of `logits` (in the same order): one
        row, or one per draft plus one, each sampled as if the drafts before it were outputs."""
        rows = [row for s in sampling for row in _sample_rows(s)]
        first = np.cumsum([0, *(1 + s.num_drafts for s in sampling)]).tolist()  # each one's first row
        allowed = None
        if masks is not None:  # a structured output drafts nothing: one row each
            allowed = ([first[i] for i in masks[0]], torch.from_numpy(masks[1].result()))
        tokens, logprobs = sample(logits, rows, self.generator, allowed)
        return {s.request.request_id: list(zip(tokens[first[i]:first[i + 1]], logprobs[first[i]:first[i + 1]]))
                for i, s in enumerate(sampling)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """The model's forward pass on this runner's KV cache: logits of `logits_rows`."""
        return self.model(input_ids, positions, self.kv_cache, batch, logits_rows)

    def close(self) -> None:
        """Release what the runner holds beyond memory (a parallel runner's ranks)."""

    def step_seconds(self, measured: float) -> float:
        """The step ran here: the host's time is its time."""
        return measured

    def _masks(self) -> MaskComputer:
        if self.mask_computer is None:
            self.mask_computer = MaskComputer(self.vocab_size)
        return self.mask_computer

    def _prepare(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[
            torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]:
        bs = self.block_size
        parts = []
        for seq in out.seqs:
            end = seq.start + seq.num_tokens
            blocks = np.asarray(kv.block_ids(seq.request.request_id)[: -(-end // bs)], dtype=np.int64)
            parts.append(StepPart(seq.request.tokens_at(seq.start, end), seq.start, blocks,
                                  seq.num_tokens == 1 + seq.num_drafts, 1 + seq.num_drafts if seq.samples else 0))
        return self.step_inputs(parts)

    def step_inputs(self, parts: list[StepPart]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]:
        """The flattened step over this runner's KV pool: input ids, positions, the attention
        batch and the rows whose logits are wanted (each part's last `logits` rows, in order)."""
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        spans: list[SeqSpan] = []
        decodes: list[tuple[int, np.ndarray, int, int]] = []  # (first row, blocks, context length, queries)
        logits_rows: list[int] = []
        bs = self.block_size
        for part in parts:
            end = part.start + len(part.ids)
            pos = np.arange(part.start, end, dtype=np.int64)
            if (self.native_decode or self.row_decode) and part.single_queries:
                decodes.append((len(ids), part.blocks, end, len(part.ids)))
            else:
                spans.append(SeqSpan(len(ids), len(part.ids), end, torch.from_numpy(part.blocks)))
            ids.extend(part.ids)
            positions.append(pos)
            slots.append(part.blocks[pos // bs] * bs + pos % bs)
            logits_rows.extend(range(len(ids) - part.logits, len(ids)))
        if not ids:  # an attention-DP rank with nothing scheduled still joins the step
            positions = slots = [np.zeros(0, dtype=np.int64)]
        batch = AttentionBatch(torch.from_numpy(np.concatenate(slots)), spans, _decode_batch(decodes, self.native_decode),
                               self.native_prefill)
        return (torch.tensor(ids, dtype=torch.long), torch.from_numpy(np.concatenate(positions)),
                batch, torch.tensor(logits_rows, dtype=torch.long))


def _sample_rows(seq: ScheduledSeq) -> list[SampleRow]:
    """The sampling rows of a sequence: its next token's, and after each draft the next one's,
    counting the drafts before it as outputs (penalties, seed stream)."""
    request = seq.request
    drafts = request.draft_token_ids[:seq.num_drafts]
    penalised = request.params.penalised
    outputs = request.all_output_token_ids if penalised else ()
    index = request.output_offset + len(request.output_token_ids)
    return [SampleRow(request.params, index + i, [*outputs, *drafts[:i]] if i and penalised else outputs,
                      request.prompt_token_ids)
            for i in range(1 + len(drafts))]


def _decode_batch(decodes: list[tuple[int, np.ndarray, int, int]], native: bool) -> DecodeBatch | None:
    """`decodes`: (first row, blocks, context length, queries) of each sequence; in the native
    kernel's form, or in the row form (each query its own entry, one key shorter than the next)."""
    if not decodes:
        return None
    if not native:
        decodes = [(first + j, blocks, end - (n - 1 - j), 1) for first, blocks, end, n in decodes for j in range(n)]
    table = np.zeros((len(decodes), max(len(b) for _, b, _, _ in decodes)), dtype=np.int64)
    for i, (_, blocks, _, _) in enumerate(decodes):
        table[i, :len(blocks)] = blocks
    rows = np.concatenate([np.arange(first, first + n, dtype=np.int64) for first, _, _, n in decodes])
    return DecodeBatch(torch.from_numpy(rows), torch.from_numpy(table),
                       torch.tensor([end for _, _, end, _ in decodes], dtype=torch.long),
                       torch.tensor([n for _, _, _, n in decodes], dtype=torch.long), native)
