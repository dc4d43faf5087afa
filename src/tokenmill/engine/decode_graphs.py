"""CUDA graphs of decode steps: one captured forward pass per padded step shape, replayed.

    graphs = DecodeGraphs(runner.forward, GraphShapes(max_batch=64, max_blocks=128), scratch_block, 16, "cuda")
    logits = graphs.run(input_ids, positions, batch, logits_rows)  # None: not a step a graph serves

A small model's decode step on a GPU is bound by launches, not by the GPU: hundreds of kernels of
microseconds each, every one prepared by the host. A graph replays all of a step's kernels with one
launch. A graph's shapes and addresses are fixed, so one is captured per (batch, block-table width)
bucket over static input buffers, the first time a step of that bucket comes, and a step is padded
up to its bucket:

- a padding row reads token 0 at position 0, writes its K/V into the scratch block (one block past
  the pool, never handed to a request) and attends to that block's first key alone: it touches no
  request's blocks and its logits are finite and unread;
- a row's block-table row is padded with the scratch block past its own blocks, and those keys are
  masked by its context length.

Only steps whose every row is a lone query over its sequence's keys (decodes, and the drafts they
verify, one row each) and gives logits are graphed; other steps (a prompt chunk), and shapes past
the largest bucket, run op by op. Graphs share one memory pool: they replay one at a time on one
stream, and each step's logits are copied out before the next replay.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.attention import AttentionBatch, DecodeBatch

if TYPE_CHECKING:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.textgen.model_config import ModelConfig

log = logging.getLogger(__name__)

Step = Callable[[], torch.Tensor]  # one forward pass over the static buffers: its logits
Capture = Callable[[Step], Step]  # a step -> what replays it
WARMUP_RUNS = 2  # lazy initialisations (library handles, workspaces) happen before the capture


def cuda_capture() -> Capture:
    """Captures into CUDA graphs sharing one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def capture(step: Step) -> Step:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits
        return replay
    return capture


def run_eagerly(step: Step) -> Step:
    """No capture: the graph's body run op by op on the same static buffers (where no GPU is)."""
    return step


@dataclass(slots=True, frozen=True)
class GraphShapes:
    max_batch: int  # sequences in the largest step graphed
    max_blocks: int  # blocks of the longest sequence
    capture: Capture | None = None  # None: CUDA graphs

    def batch_buckets(self) -> list[int]:
        """1, 2, 4, then every multiple of 8, up to max_batch (as vLLM pads its graphed batches)."""
        small = [b for b in (1, 2, 4) if b < self.max_batch]
        return [*small, *range(8, self.max_batch, 8), self.max_batch]

    def width_buckets(self) -> list[int]:
        """Powers of two from 8 blocks, then max_blocks: attention reads a bucket's whole width."""
        widths = []
        width = 8
        while width < self.max_blocks:
            widths.append(width)
            width *= 2
        return [*widths, self.max_blocks]


@dataclass(slots=True)
class StaticStep:
    """The buffers a graph reads, at one (batch, width) bucket, and what replays it."""
    input_ids: torch.Tensor  # [batch]
    positions: torch.Tensor  # [batch]
    slots: torch.Tensor  # [batch]
    table: torch.Tensor  # [batch, width]
    context_lens: torch.Tensor  # [batch]
    rows: torch.Tensor  # arange(batch): every row decodes and gives logits

    @classmethod
    def padding(cls, batch: int, width: int, scratch_block: int, block_size: int, device: str) -> StaticStep:
        """Buffers holding padding rows only: what warm-up and capture run on."""
        def full(shape: tuple[int, ...], value: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.long, device=device)
        return cls(full((batch,), 0), full((batch,), 0), full((batch,), scratch_block * block_size),
                   full((batch, width), scratch_block), full((batch,), 1), torch.arange(batch, device=device))

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, decode: DecodeBatch,
             scratch_block: int, block_size: int) -> None:
        """This step's rows first, padding rows after them (host tensors in, one copy each)."""
        batch, width = self.table.shape
        n, used = decode.block_table.shape
        table = torch.full((batch, width), scratch_block, dtype=torch.long)
        table[:n, :used] = decode.block_table
        self.table.copy_(table)
        for buffer, values, pad in ((self.input_ids, input_ids, 0), (self.positions, positions, 0),
                                    (self.slots, slots, scratch_block * block_size),
                                    (self.context_lens, decode.context_lens, 1)):
            padded = torch.full((batch,), pad, dtype=torch.long)
            padded[:n] = values
            buffer.copy_(padded)


def graph_shapes(config: EngineConfig, model: ModelConfig, max_model_len: int) -> GraphShapes | None:
    """The graphs a runner captures: on a GPU unless `--enforce-eager`, for a model whose forward
    pass never waits on the host (sparse MoE routing counts its tokens per expert on the host);
    up to a step of every sequence with all its drafts."""
    if config.device != "cuda" or config.enforce_eager or model.moe is not None:
        return None
    rows = config.max_num_seqs * (1 + (config.speculative.num_tokens if config.speculative else 0))
    return GraphShapes(min(rows, config.max_num_batched_tokens), -(-max_model_len // config.block_size))


class DecodeGraphs:
    def __init__(self, forward: Callable[..., torch.Tensor], shapes: GraphShapes, scratch_block: int,
                 block_size: int, device: str) -> None:
        """`forward(input_ids, positions, batch, logits_rows)` is the runner's forward pass;
        `scratch_block` a block of its KV pool that no request is given."""
        self.forward = forward
        self.shapes = shapes
        self.capture = shapes.capture or cuda_capture()
        self.batches, self.widths = shapes.batch_buckets(), shapes.width_buckets()
        self.scratch_block, self.block_size, self.device = scratch_block, block_size, device
        self.steps: dict[tuple[int, int], tuple[StaticStep, Step]] = {}
        self.replayed = 0  # steps served by a graph

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
            logits_rows: torch.Tensor) -> torch.Tensor | None:
        """The step's logits (on the device) from its bucket's graph; None when no graph serves it."""
        bucket = self.bucket_of(batch, input_ids.numel(), logits_rows.numel())
        if bucket is None or batch.decode is None:
            return None
        step, replay = self.steps.get(bucket) or self._capture(*bucket)
        step.load(input_ids, positions, batch.slot_mapping, batch.decode, self.scratch_block, self.block_size)
        self.replayed += 1
        return replay()[:input_ids.numel()]

    def bucket_of(self, batch: AttentionBatch, tokens: int, logits: int) -> tuple[int, int] | None:
        """The (batch, width) bucket of a step whose rows are each a lone query (the decode batch's
        row form: one context length and one block-table row per row) and each give logits; or None."""
        d = batch.decode
        if d is None or d.native or batch.spans or tokens == 0 or d.rows.numel() != tokens or logits != tokens:
            return None
        size = next((b for b in self.batches if b >= tokens), None)
        width = next((w for w in self.widths if w >= d.block_table.shape[1]), None)
        return None if size is None or width is None else (size, width)

    def _capture(self, size: int, width: int) -> tuple[StaticStep, Step]:
        step = StaticStep.padding(size, width, self.scratch_block, self.block_size, self.device)
        decode = DecodeBatch(step.rows, step.table, step.context_lens, torch.ones_like(step.rows), native=False)
        batch = AttentionBatch(step.slots, [], decode)
        replay = self.capture(lambda: self.forward(step.input_ids, step.positions, batch, step.rows))
        self.steps[(size, width)] = (step, replay)
        log.info("captured the decode step of %d rows over %d blocks each (%d graphs)", size, width, len(self.steps))
        return step, replay
