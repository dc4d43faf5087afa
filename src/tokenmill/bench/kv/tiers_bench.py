"""`tokenmill bench tiers`: TTFT of an agentic workload with KV tiers (host + disk) vs device
only, and the first request on a corpus at a second replica with a shared tier vs none.

Workload (scaled to small-moe's 4,096-token context): `--agents` agents share one
`--corpus-tokens` corpus (default 2,048, not 4,096, so the last turn still fits); each runs
`--turns` turns, a turn appending `--turn-tokens` new tokens plus the previous answer
(`--output-tokens`, greedy, exact length) to its own history. Requests run one at a time,
agents round-robin within a turn; TTFT is the time from `add_request` to the first token,
in-process. The device pool is a quarter of the working set (corpus + every history), but
never below the longest prompt plus a few blocks. The modes run side by side, one engine
each, taking turns request by request (see `_agent_loop`), so background load on a shared
machine does not skew their ratio. Cross-replica: engine A computes the
corpus plus a question (shared tier written through); engine B then answers the corpus
plus another question, with the same shared tier (Redis, a `redis-server` child on
loopback unless `--kv-shared` is given; a directory when redis-server is missing) vs none,
averaged over `--cross-repeats` fresh corpora.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierRun:
    name: str
    mean_ttft_s: float
    p90_ttft_s: float
    prefill_tokens: int
    onboarded_tokens: int
    requests: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: make small-moe in a temp dir)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--corpus-tokens", type=int, default=2048)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--cross-repeats", type=int, default=3, help="corpora the cross-replica figure averages")
    parser.add_argument("--kv-shared", default=None, help="shared tier for the cross-replica part (redis://… or dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here")


def run(args: argparse.Namespace) -> int:
    for name in ("threads", "agents", "turns", "corpus_tokens", "turn_tokens", "output_tokens", "cross_repeats"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    with tempfile.TemporaryDirectory(prefix="tm-tiers-") as tmp:
        model = args.model or str(_make_model(Path(tmp) / "small-moe"))
        agentic = _agentic(args, model, Path(tmp))
        cross = _cross_replica(args, model, Path(tmp))
    report = {"agentic": [asdict(r) for r in agentic], "cross_replica": cross}
    _render(agentic, cross)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _make_model(out: Path) -> Path:
    from tokenmill.engine.make_model import write_model

    log.info("writing small-moe to %s", out)
    return write_model("small-moe", out, seed=0)


def _engine(model: str, args: argparse.Namespace, blocks: int, worker: str, **tiers: Any) -> Any:
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model=model, threads=args.threads, num_kv_blocks=blocks, max_num_seqs=8,
                       max_num_batched_tokens=4096, worker_id=worker, seed=args.seed, **tiers)
    return LLMEngine(cfg, load_tokenizer=False)


def _ttft(engine: Any, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds to the first token, and every output token (run to completion)."""
    from tokenmill.textgen.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    first, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if first is None and tokens:
                first = time.perf_counter() - start
    return first or 0.0, tokens


def _tokens(rng: random.Random, model: str, n: int) -> list[int]:
    from tokenmill.textgen.model_config import load_model_config

    vocab = load_model_config(model).vocab_size
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def _agentic(args: argparse.Namespace, model: str, tmp: Path) -> list[TierRun]:
    rng = random.Random(args.seed)
    corpus = _tokens(rng, model, args.corpus_tokens)
    turns = [[_tokens(rng, model, args.turn_tokens) for _ in range(args.turns)] for _ in range(args.agents)]
    per_turn = args.turn_tokens + args.output_tokens
    working = (args.corpus_tokens + args.agents * args.turns * per_turn) // 16
    longest = (args.corpus_tokens + args.turns * per_turn) // 16 + 4
    blocks = max(working // 4, longest)
    block_gb = _block_bytes(model) / 2**30
    log.info("working set %d blocks, device pool %d blocks (%.0f%%)", working, blocks, 100 * blocks / working)
    modes: list[tuple[str, dict[str, Any]]] = [("device-only", {})]
    for fraction in (0.5, 1.0):  # host holding half / all of the working set; disk twice it
        modes.append((f"host{fraction:.0%}+disk", {"kv_host_gb": block_gb * working * fraction,
                                                   "kv_disk_dir": str(tmp / f"disk{fraction}"),
                                                   "kv_disk_gb": block_gb * working * 2}))
    engines = [_engine(model, args, blocks, name, **tiers) for name, tiers in modes]
    try:
        ttfts = _agent_loop(engines, args, corpus, turns)
        runs = []
        for (name, _), engine, times in zip(modes, engines, ttfts, strict=True):
            stats = engine.stats()
            runs.append(TierRun(name, statistics.fmean(times), _p90(times), stats.prefill_tokens,
                                stats.onboarded_tokens, len(times)))
            log.info("%s: mean TTFT %.3fs", name, runs[-1].mean_ttft_s)
        return runs
    finally:
        for engine in engines:
            engine.close()


def _agent_loop(engines: list[Any], args: argparse.Namespace, corpus: list[int],
                turns: list[list[list[int]]]) -> list[list[float]]:
    """Every mode serves the same request back to back, in an order that rotates per request,
    before the next request starts: on a shared machine a change of background load then
    hits every mode alike instead of whichever mode happened to run during it (run one
    after the other, the modes' ratio moved by 2x with other jobs). Each engine's offload
    queue is drained after its request, outside the timing, so its background stores never
    land in another mode's TTFT; a request's own evictions still overlap its own prefill.
    Each mode keeps its own histories: outputs have a fixed length, so every mode does the same
    work, but in bf16 a near-tied greedy pick can differ with the prefill's shape.
    Per-mode TTFTs, in request order."""
    histories = [[list(corpus) for _ in range(args.agents)] for _ in engines]
    ttfts: list[list[float]] = [[] for _ in engines]
    request = 0
    for turn in range(args.turns):
        for agent in range(args.agents):
            for i in _rotated(len(engines), request):
                history = histories[i][agent]
                history.extend(turns[agent][turn])
                ttft, output = _ttft(engines[i], f"a{agent}-t{turn}", history, args.output_tokens)
                history.extend(output)
                ttfts[i].append(ttft)
                if engines[i].tiers is not None:
                    engines[i].tiers.manager.drain(timeout_s=60)
            request += 1
    return ttfts


def _rotated(n: int, shift: int) -> list[int]:
    return [(shift + i) % n for i in range(n)]


def _cross_replica(args: argparse.Namespace, model: str, tmp: Path) -> dict[str, float]:
    """Mean over `--cross-repeats` corpora (a fresh one each, so no repeat finds another's
    blocks), the two cases alternating which goes first: each figure is one request, so a
    single measurement on a shared machine moved by 2x."""
    rng = random.Random(args.seed + 1)
    blocks = (args.corpus_tokens + 64) // 16 + 8
    server, shared = _shared_tier(args, tmp)
    try:
        cases = [("none", {}), ("shared", {"kv_shared": shared})]
        ttfts: dict[str, list[float]] = {name: [] for name, _ in cases}
        result: dict[str, float] = {}
        for repeat in range(args.cross_repeats):
            corpus = _tokens(rng, model, args.corpus_tokens)
            questions = [_tokens(rng, model, 32) for _ in range(2)]
            for name, tiers in cases[repeat % 2:] + cases[:repeat % 2]:
                ttft, prefill = _second_replica_ttft(args, model, blocks, tiers, corpus, questions)
                ttfts[name].append(ttft)
                result[f"prefill_tokens_{name}"] = float(prefill)
        for name, values in ttfts.items():
            result[f"ttft_{name}_s"] = statistics.fmean(values)
        result["shared_tier"] = 0.0 if shared.startswith("redis://") else 1.0
        return result
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)


def _second_replica_ttft(args: argparse.Namespace, model: str, blocks: int, tiers: dict[str, Any],
                         corpus: list[int], questions: list[list[int]]) -> tuple[float, int]:
    """Replica A answers corpus + question 0 (writing through to `tiers`' shared tier, if any);
    then a fresh replica B answers corpus + question 1: B's TTFT and prefill token count."""
    a = _engine(model, args, blocks, "replica-a", **tiers, kv_write_through=bool(tiers))
    b = None
    try:
        _ttft(a, "a", corpus + questions[0], 2)
        if a.tiers is not None:
            a.tiers.manager.drain(timeout_s=60)
        b = _engine(model, args, blocks, "replica-b", **tiers)
        ttft, _ = _ttft(b, "b", corpus + questions[1], 2)
        return ttft, b.stats().prefill_tokens
    finally:
        a.close()
        if b is not None:
            b.close()


def _shared_tier(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
    if args.kv_shared:
        return None, args.kv_shared
    binary = shutil.which("redis-server")
    if binary is None:
        log.warning("redis-server not found: the shared tier is a directory")
        return None, str(tmp / "shared")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                               "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_port(port)
    return server, f"redis://127.0.0.1:{port}/0"


def _wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not come up on port {port}")


def _block_bytes(model: str) -> int:
    from tokenmill.textgen.model_config import load_model_config

    cfg = load_model_config(model)
    itemsize = 2 if cfg.checkpoint_dtype in ("bfloat16", "float16") else 4
    return 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * itemsize


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _render(agentic: list[TierRun], cross: dict[str, float]) -> None:
    lines = [f"{'mode':<16} {'requests':>8} {'mean TTFT s':>12} {'p90 TTFT s':>11} {'prefill tok':>12} "
             f"{'onboarded':>10}"]
    lines += [f"{r.name:<16} {r.requests:>8} {r.mean_ttft_s:>12.3f} {r.p90_ttft_s:>11.3f} {r.prefill_tokens:>12} "
              f"{r.onboarded_tokens:>10}" for r in agentic]
    lines += [f"mean TTFT speedup, {r.name} vs device-only: {agentic[0].mean_ttft_s / r.mean_ttft_s:.2f}x "
              "(target >= 4x)" for r in agentic[1:]]
    lines.append(f"cross-replica first request at B: none {cross['ttft_none_s']:.3f}s "
                 f"({cross['prefill_tokens_none']:.0f} prefill tok), shared {cross['ttft_shared_s']:.3f}s "
                 f"({cross['prefill_tokens_shared']:.0f} prefill tok): "
                 f"{cross['ttft_none_s'] / cross['ttft_shared_s']:.2f}x (target >= 3x)")
    sys.stdout.write("\n".join(lines) + "\n")
