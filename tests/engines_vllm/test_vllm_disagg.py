"""One prefill and one decode vLLM worker behind `tokenmill serve`, their KV moved by
`TokenmillConnector`: the same greedy text as vLLM alone, streamed or not, with the decode worker
computing no prompt token but the last; a short prompt kept on the decode worker (conditional
disaggregation); a corrupted pull recomputed to the same text, in the same deployment (it
corrupts only every fifth pull); and no vLLM block left held on either side. The connector's other failures (a dropped connection, blocks no longer held, a
layout that differs) are driven without vLLM in test_connector_worker.py."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.engines_vllm.conftest import VLLMAlone, left_behind, start_serving
from tests.serving.conftest import Server, stop_server
from tests.serving.probes import metric, wait
from tokenmill.runtime.shared_segments import python_files
from tokenmill.textgen.detokenizer import IncrementalDetokenizer
from tokenmill.textgen.tokenizer import Tokenizer

MAX_TOKENS = 16
THRESHOLD = 64  # --disagg-threshold: shorter prompts are prefilled on the decode worker
CORRUPT_EVERY = 5  # --transfer-faults corrupt=5: the decode worker corrupts its 5th, 10th, ... pull
# distinct prompts (a repeat would find its blocks cached on the decode worker and stay there); the
# corrupt test sends as many as it takes to reach the next corrupted pull
PROMPTS = {"medium": 100, "medium-streamed": 110, "long": 300, "long-streamed": 290, "local": 20,
           **{f"corrupt-{i}": 200 + i for i in range(CORRUPT_EVERY)}}


def prompt(seed: int, length: int) -> list[int]:
    return [150 + seed] + [(seed * 6007 + i * 7919) % 1800 + 200 for i in range(length - 1)]


PROMPT_IDS = {name: prompt(seed, length) for seed, (name, length) in enumerate(PROMPTS.items())}


@pytest.fixture(scope="module", autouse=True)
def reference(small_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[int]]]:
    """vLLM alone's greedy ids per prompt, started first so it runs while the deployments start."""
    run = VLLMAlone(small_llama, list(PROMPT_IDS.values()), MAX_TOKENS, tmp_path_factory.mktemp("vllm-alone"))
    try:
        yield dict(zip(PROMPT_IDS, run.outputs()))
    finally:
        run.stop()


@pytest.fixture(scope="module")
def disagg(small_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    before = python_files()
    server = start_serving(small_llama, tmp_path_factory.mktemp("vllm-disagg"), "--prefill", "1", "--decode", "1",
                           "--disagg-threshold", str(THRESHOLD), "--transfer-faults", f"corrupt={CORRUPT_EVERY}",
                           workers=2)
    try:
        yield server
    finally:
        stop_server(server)
    assert not left_behind(before), "vLLM's shared-memory queues outlived the deployment"


def text_of(model: Path, prompt_ids: list[int], output_ids: list[int]) -> str:
    detok = IncrementalDetokenizer(Tokenizer(model), prompt_ids)
    return detok.add(output_ids) + detok.flush()


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, ids: list[int], stream: bool = False) -> str:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                              "extra_body": {"ignore_eos": True}}
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    return client.completions.create(**kwargs).choices[0].text


def worker_gauge(server: Server, name: str, worker: str) -> float:
    return metric(server.url, f"tokenmill_worker_{name}", worker=worker)


def no_block_held(server: Server) -> bool:
    return metric(server.url, "tokenmill_worker_kv_usage") == 0 and metric(server.url, "tokenmill_worker_num_running") == 0


def test_disaggregated_text_equals_vllm_alone_and_the_decode_worker_computes_one_prompt_token(
        disagg: Server, small_llama: Path, reference: dict[str, list[int]]) -> None:
    client = client_of(disagg)
    computed = worker_gauge(disagg, "prefill_tokens", "decode-0")
    for name in PROMPTS:
        if name.startswith(("medium", "long")):
            expected = text_of(small_llama, PROMPT_IDS[name], reference[name])
            assert complete(client, PROMPT_IDS[name], stream=name.endswith("streamed")) == expected, name
    # four requests, each pulled its prompt: the decode worker computed only the prefill's token
    # (the workers' counters reach the frontend with their next heartbeat)
    wait(lambda: worker_gauge(disagg, "kv_handles", "prefill-0") == 4, "the prefill worker's four handles")
    wait(lambda: worker_gauge(disagg, "prefill_tokens", "decode-0") - computed == 4,
         "the decode worker's four computed prompt tokens")
    wait(lambda: no_block_held(disagg), "both workers' vLLM blocks back to idle", 20)


def test_a_short_prompt_stays_on_the_decode_worker(disagg: Server, small_llama: Path,
                                                   reference: dict[str, list[int]]) -> None:
    handles = worker_gauge(disagg, "kv_handles", "prefill-0")
    computed = worker_gauge(disagg, "prefill_tokens", "decode-0")
    ids = PROMPT_IDS["local"]
    assert len(ids) < THRESHOLD
    assert complete(client_of(disagg), ids) == text_of(small_llama, ids, reference["local"])
    wait(lambda: worker_gauge(disagg, "prefill_tokens", "decode-0") - computed == len(ids),
         "the decode worker's own prefill of the short prompt")
    assert worker_gauge(disagg, "kv_handles", "prefill-0") == handles


def test_a_corrupted_pull_is_recomputed_to_the_same_text(disagg: Server, small_llama: Path,
                                                        reference: dict[str, list[int]]) -> None:
    """Pulls up to the next corrupted one verify; that one fails its checksum and the decode worker
    recomputes the prompt: vLLM alone's text either way."""
    client = client_of(disagg)
    pulls = int(worker_gauge(disagg, "kv_handles", "prefill-0"))  # one pull per handle, numbered from 1
    names = [f"corrupt-{i}" for i in range(CORRUPT_EVERY - pulls % CORRUPT_EVERY)]
    computed = worker_gauge(disagg, "prefill_tokens", "decode-0")
    for name in names:
        assert complete(client, PROMPT_IDS[name]) == text_of(small_llama, PROMPT_IDS[name], reference[name]), name
    # each verified pull left one token to compute; the corrupted one its whole prompt and first token
    recomputed = len(PROMPT_IDS[names[-1]]) + 1
    wait(lambda: worker_gauge(disagg, "prefill_tokens", "decode-0") - computed == len(names) - 1 + recomputed,
         "one token per verified pull and the recompute of the corrupted one")
    wait(lambda: worker_gauge(disagg, "kv_handles", "prefill-0") == pulls + len(names), "the prefill worker's handles")
    wait(lambda: no_block_held(disagg), "both workers' vLLM blocks back to idle", 20)
