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
                                               _array(decode.context_lens)],
    })


def unpack_step(data: bytes) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]:
    m = msgpack.unpackb(data)
    spans = [SeqSpan(start, qlen, ctx, _tensor(blocks)) for start, qlen, ctx, blocks in m["spans"]]
    decode = None if m["decode"] is None else DecodeBatch(*(_tensor(x) for x in m["decode"]))
    batch = AttentionBatch(_tensor(m["slots"]), spans, decode, m["native_prefill"])
    return _tensor(m["ids"]), _tensor(m["pos"]), batch, _tensor(m["logits"])
