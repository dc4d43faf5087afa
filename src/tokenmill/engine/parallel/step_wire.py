"""One forward step's inputs as msgpack bytes, for rank 0 to broadcast to the other ranks
(no pickles on the wire): token ids, positions, the attention batch and the logits rows.
An empty message tells the ranks to stop."""
from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch

from tokenmill.engine.attention import AttentionBatch, DecodeBatch, SeqSpan

STOP = b""
Step = tuple[torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]  # ids, positions, batch, logits rows


def _array(t: torch.Tensor) -> list[Any]:
    a = t.numpy()
    return [a.dtype.str, list(a.shape), a.tobytes()]


def _tensor(item: list[Any]) -> torch.Tensor:
    dtype, shape, raw = item
    return torch.from_numpy(np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy())


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
              logits_rows: torch.Tensor) -> bytes:
    decode = batch.decode
    return msgpack.packb({
        "ids": _array(input_ids), "pos": _array(positions), "slots": _array(batch.slot_mapping),
        "logits": _array(logits_rows), "native_prefill": batch.native_prefill,
        "spans": [[s.query_start, s.query_len, s.context_len, _array(s.block_ids)] for s in batch.spans],
        "decode": None if decode is None else [_array(decode.rows), _array(decode.block_table),
                                               _array(decode.context_lens), _array(decode.queries), decode.native],
    })


def unpack_step(data: bytes) -> Step:
    m = msgpack.unpackb(data)
    spans = [SeqSpan(start, qlen, ctx, _tensor(blocks)) for start, qlen, ctx, blocks in m["spans"]]
    decode = None if m["decode"] is None else DecodeBatch(*(_tensor(x) for x in m["decode"][:4]), m["decode"][4])
    batch = AttentionBatch(_tensor(m["slots"]), spans, decode, m["native_prefill"])
    return _tensor(m["ids"]), _tensor(m["pos"]), batch, _tensor(m["logits"])


def pack_ranks_step(counts: list[int], rows: list[int], steps: list[Step]) -> bytes:
    """An attention-DP step: every rank's token and logits-row counts, and ranks 1..N-1's own
    inputs (`steps`, in rank order)."""
    return msgpack.packb({"counts": counts, "rows": rows, "steps": [pack_step(*s) for s in steps]})


def unpack_ranks_step(data: bytes, rank: int) -> tuple[list[int], list[int], Step]:
    """The counts, and rank `rank`'s (>= 1) own inputs."""
    m = msgpack.unpackb(data)
    return m["counts"], m["rows"], unpack_step(m["steps"][rank - 1])
