"""CUDA graphs of decode steps: one captured forward pass per padded step shape, replayed.

    graphs = DecodeGraphs(runner.forward, GraphShapes(max_batch=64, max_blocks=128), scratch_block,
                          block_size=16, vocab_size=49152, device="cuda")
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
the largest bucket, run op by op, as do a bucket's steps if its capture fails (out of memory).
Graphs share one memory pool: they replay one at a time on one stream, each writing its logits
into one buffer outside the pool, copied to the host before the next replay.
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
    """The inputs a graph reads at one (batch, width) bucket: one device buffer laid out as
    [input ids | positions | slots | context lengths | block table, batch x width], filled each
    step from a host buffer of the same layout (pinned on a GPU host) by one copy."""
    device_buffer: torch.Tensor  # int64 [batch * (4 + width)]
    host_buffer: torch.Tensor
    batch: int
    width: int

    @classmethod
    def padding(cls, batch: int, width: int, scratch_block: int, block_size: int, device: str) -> StaticStep:
        """Buffers holding padding rows only: what warm-up and capture run on."""
        host = torch.empty(batch * (4 + width), dtype=torch.long, pin_memory=device != "cpu")
        step = cls(torch.empty(host.shape, dtype=torch.long, device=device), host, batch, width)
        step._pad(scratch_block, block_size)
        step.device_buffer.copy_(host)
        return step

    def views(self, buffer: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(input ids, positions, slots, context lengths, block table) of `buffer` (the device's)."""
        b, buf = self.batch, self.device_buffer if buffer is None else buffer
        return buf[:b], buf[b:2 * b], buf[2 * b:3 * b], buf[3 * b:4 * b], buf[4 * b:].view(b, self.width)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, decode: DecodeBatch,
             scratch_block: int, block_size: int) -> None:
        """This step's rows first, padding rows after them."""
        self._pad(scratch_block, block_size)
        n, used = decode.block_table.shape
        ids, pos, slot, lens, table = self.views(self.host_buffer)
        ids[:n], pos[:n], slot[:n], lens[:n] = input_ids, positions, slots, decode.context_lens
        table[:n, :used] = decode.block_table
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)  # done before the logits reach the host

    def _pad(self, scratch_block: int, block_size: int) -> None:
        ids, pos, slot, lens, table = self.views(self.host_buffer)
        ids.zero_()
        pos.zero_()
        slot.fill_(scratch_block * block_size)
        lens.fill_(1)
        table.fill_(scratch_block)


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
                 block_size: int, vocab_size: int, device: str) -> None:
        """`forward(input_ids, positions, batch, logits_rows)` is the runner's forward pass;
        `scratch_block` a block of its KV pool that no request is given."""
        self.forward = forward
        self.capture = shapes.capture or cuda_capture()
        self.batches, self.widths = shapes.batch_buckets(), shapes.width_buckets()
        self.scratch_block, self.block_size, self.device = scratch_block, block_size, device
        # every graph writes its logits here, outside the graphs' pool: a graph's own output would
        # stay allocated in the pool, one [batch, vocab] per graph
        self.logits = torch.empty(shapes.max_batch, vocab_size, dtype=torch.float32, device=device)
        self.steps: dict[tuple[int, int], tuple[StaticStep, Step] | None] = {}  # None: its capture failed
        self.replayed = 0  # steps served by a graph

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
            logits_rows: torch.Tensor) -> torch.Tensor | None:
        """The step's logits (on the device) from its bucket's graph; None when no graph serves it.
        They stay valid until the next step."""
        bucket = self.bucket_of(batch, input_ids.numel(), logits_rows.numel())
        if bucket is None or batch.decode is None:
            return None
        graph = self.steps[bucket] if bucket in self.steps else self._capture(*bucket)
        if graph is None:
            return None
        step, replay = graph
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

    def _capture(self, size: int, width: int) -> tuple[StaticStep, Step] | None:
        step = StaticStep.padding(size, width, self.scratch_block, self.block_size, self.device)
        ids, positions, slots, lens, table = step.views()
        rows = torch.arange(size, device=self.device)
        batch = AttentionBatch(slots, [], DecodeBatch(rows, table, lens, torch.ones_like(rows), native=False))
        logits = self.logits[:size]
        try:
            replay = self.capture(lambda: logits.copy_(self.forward(ids, positions, batch, rows)))
        except RuntimeError as exc:  # out of memory, above all: such steps run op by op instead
            log.warning("no graph for decode steps of %d rows over %d blocks (%s); they run op by op", size, width,
                        exc)
            self.steps[(size, width)] = None
            return None
        self.steps[(size, width)] = (step, replay)
        log.info("captured the decode step of %d rows over %d blocks each (%d graphs)", size, width, len(self.steps))
        return step, replay
