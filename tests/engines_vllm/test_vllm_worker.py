"""Two vLLM workers behind `tokenmill serve --router kv`: the same greedy text as vLLM alone, the
router's index equal to what vLLM caches (and losing what it evicts), KV routing to the holder,
cancel freeing vLLM's blocks, grammars, and a killed worker's stream finished on the other one.
The kill runs last: it takes a worker down for the rest of the module."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.engines_vllm.conftest import BLOCK_SIZE, VLLM_START_S, Deployment, VLLMAlone
from tests.serving.probes import child_pids, kill_the_routed_worker, metric, stream_with_a_kill, wait
from tests.serving.test_dashboard import _points
from tests.serving.test_runtime_scaling import state_is, wait_for
from tokenmill.kv.hashing import block_hashes
from tokenmill.planner.decision import Action, Decision
from tokenmill.planner.live import LiveDeployment
from tokenmill.procs import process_alive
from tokenmill.textgen.detokenizer import IncrementalDetokenizer
from tokenmill.textgen.tokenizer import Tokenizer

MAX_TOKENS = 24
KILL_TOKENS = 600  # long enough that the stream is still generating when its first chunk is read
# vLLM generates the small model's tokens faster than a client starved by a busy host may read them:
# killed after the 40th chunk, and once after the 8th, the worker had sent all 600 already and nothing
# migrated. So the kill comes at the first chunk, and both workers are stopped (SIGSTOP) at once
# while the test finds the stream's one, so that it cannot finish meanwhile.
KILL_AFTER_CHUNKS = 1
MESSAGES = [{"role": "user", "content": "Tell me about Elizabeth and Mr Darcy."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "count"],
          "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"enum": ["Paris", "Lyon"]}}}}}]


def prompt(seed: int, length: int) -> list[int]:
    """Token ids no other prompt of this module starts with (the first id says which prompt)."""
    return [100 + seed] + [(seed * 7919 + i * 104729) % 1800 + 200 for i in range(length - 1)]


PROMPTS = {"short": prompt(1, 40), "long": prompt(2, 300), "kill": prompt(3, 60), "index": prompt(10, 200)}


@pytest.fixture(scope="module")
def tokenizer(small_llama: Path) -> Tokenizer:
    return Tokenizer(small_llama)


@pytest.fixture(scope="module", autouse=True)
def reference_run(small_llama: Path, tokenizer: Tokenizer,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, list[int]], VLLMAlone]]:
    """vLLM alone on this module's prompts, started first (autouse) so it runs while the deployment starts."""
    prompts = {**PROMPTS, "chat": tokenizer.apply_chat_template(MESSAGES)}
    run = VLLMAlone(small_llama, list(prompts.values()), KILL_TOKENS, tmp_path_factory.mktemp("vllm-alone"))
    try:
        yield prompts, run
    finally:
        run.stop()


@pytest.fixture(scope="module")
def client(vllm_deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_deployment.server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(reference_run: tuple[dict[str, list[int]], VLLMAlone]) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (prompt ids, vLLM alone's greedy ids)."""
    prompts, run = reference_run
    return {name: (ids, out) for (name, ids), out in zip(prompts.items(), run.outputs())}


def text_of(tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return detok.add(output_ids) + detok.flush()


def index(deployment: Deployment) -> dict[str, set[int]]:
    """worker -> the device-tier hashes the decode pool's KV index holds for it."""
    body = httpx.get(f"{deployment.server.url}/admin/router/index?hashes=true", timeout=10, trust_env=False).json()
    return {worker: set(view["tiers"].get("device", {}).get("hashes", []))
            for worker, view in body["decode"]["workers"].items()}


def cached_tokens(client: openai.OpenAI, ids: list[int]) -> int:
    result = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0)
    return result.usage.prompt_tokens_details.cached_tokens


def test_greedy_text_equals_vllm_alone_streamed_or_not(client: openai.OpenAI, tokenizer: Tokenizer,
                                                       reference: dict[str, Any]) -> None:
    for name in ("short", "long"):
        ids, out = reference[name]
        expected = text_of(tokenizer, ids, out[:MAX_TOKENS])
        whole = client.completions.create(model="tiny", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert whole.choices[0].text == expected, name
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), MAX_TOKENS)
        chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected, name
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    ids, out = reference["chat"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == text_of(tokenizer, ids, out[:MAX_TOKENS])
    assert chat.usage.prompt_tokens == len(ids)


def test_the_index_holds_what_vllm_caches_and_loses_what_it_evicts(vllm_deployment: Deployment,
                                                                  client: openai.OpenAI,
                                                                  reference: dict[str, Any]) -> None:
    ids, out = reference["index"]
    before = index(vllm_deployment)
    client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    # vLLM caches every full block of what it computed: the prompt and all outputs but the last
    expected = set(block_hashes(ids + out[:7], BLOCK_SIZE))
    wait(lambda: any(expected <= held for held in index(vllm_deployment).values()), "the stored events")
    after = index(vllm_deployment)
    [holder] = [w for w, held in after.items() if expected <= held]
    assert after[holder] - before.get(holder, set()) == expected  # nothing else, nothing hashed otherwise
    assert cached_tokens(client, ids) == (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    # prompts that share its first two blocks go to its holder (KV routing), and each of their 17 new
    # blocks pushes the least recently used out of its 48: the first prompt's other blocks
    shared = ids[:2 * BLOCK_SIZE]
    hits = []
    for seed in range(20, 24):
        # the last one's blocks leave the router's load view when the frontend has finished it,
        # which may be just after the client has its answer: route each on an idle fleet
        wait(lambda: metric(vllm_deployment.server.url, "tokenmill_router_worker_load_blocks") == 0,
             "the router's load back to zero")
        hits.append(cached_tokens(client, shared + prompt(seed, 540)))
    assert hits == [len(shared)] * 4  # each found the shared blocks: it went to their holder
    wait(lambda: not expected <= index(vllm_deployment)[holder], "the removal events", 20)
    assert set(block_hashes(shared, BLOCK_SIZE)) <= index(vllm_deployment)[holder]  # those stayed in use


def test_kv_routing_sends_a_repeated_prompt_to_its_holder_and_round_robin_does_not(
        vllm_deployment: Deployment, client: openai.OpenAI) -> None:
    url = vllm_deployment.server.url
    long_prompt = prompt(30, 700)
    assert cached_tokens(client, long_prompt) == 0
    assert all(cached_tokens(client, long_prompt) >= 672 for _ in range(3))  # 21 of its 22 blocks
    switched = httpx.post(f"{url}/admin/settings", json={"kv_routing": False}, timeout=10, trust_env=False)
    assert switched.status_code == 200, switched.text
    try:
        other = prompt(31, 700)
        first, second = cached_tokens(client, other), cached_tokens(client, other)
        assert (first, second) == (0, 0)  # round-robin: the repeat went to the other worker
    finally:
        httpx.post(f"{url}/admin/settings", json={"kv_routing": True}, timeout=10, trust_env=False)


def test_cancel_mid_stream_frees_vllm_blocks(vllm_deployment: Deployment, client: openai.OpenAI) -> None:
    url = vllm_deployment.server.url
    wait(lambda: metric(url, "tokenmill_worker_kv_usage") == 0, "idle workers")
    disconnected = metric(url, "tokenmill_requests_total", status="disconnected")
    stream = client.completions.create(model="tiny", prompt=prompt(40, 100), max_tokens=800, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    # vLLM may generate the rest before a heartbeat carries the stream's blocks: its engine cores are
    # stopped while the blocks are seen in use, and resumed once the client has gone
    cores = [core for worker in vllm_deployment.server.registry() for core in _children(int(worker["pid"]))
             if _cmdline(core).startswith("VLLM::")]
    assert cores, "no vLLM engine core process"
    for core in cores:
        os.kill(core, signal.SIGSTOP)
    try:
        wait(lambda: metric(url, "tokenmill_worker_kv_usage") > 0, "the stream's blocks in use", 10)
        stream.close()
    finally:
        for core in cores:
            os.kill(core, signal.SIGCONT)
    wait(lambda: metric(url, "tokenmill_worker_kv_usage") == 0 and metric(url, "tokenmill_worker_num_running") == 0,
         "vLLM's blocks back to idle", 20)
    # ended by the client, not run to its 800th token
    wait(lambda: metric(url, "tokenmill_requests_total", status="disconnected") == disconnected + 1,
         "the stream counted as disconnected", 10)


def test_json_schema_validates_and_a_forced_tool_call_parses(client: openai.OpenAI) -> None:
    for seed in range(3):
        result = client.chat.completions.create(
            model="tiny", messages=MESSAGES, seed=seed, temperature=1.0, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}})
        assert result.choices[0].finish_reason == "stop", result.choices[0]
        jsonschema.validate(json.loads(result.choices[0].message.content), SCHEMA)
    call = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=1,
                                          max_tokens=96,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [tool_call] = call.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather"
    jsonschema.validate(json.loads(tool_call.function.arguments), TOOLS[0]["function"]["parameters"])


class ScriptedPlanner:
    """Decides what the test says, one list of actions a tick: the planner's policy is tested
    elsewhere; here, its local connector acting on vLLM workers."""

    def __init__(self, script: list[list[Action]]) -> None:
        self.script = script

    def step(self, observation: Any) -> Decision:
        return Decision(observation.at_s, "scripted", observation, {}, actions=self.script.pop(0))


def test_the_planner_starts_and_drains_a_vllm_worker_and_the_dashboard_shows_it(
        vllm_deployment: Deployment) -> None:
    server = vllm_deployment.server
    planner = ScriptedPlanner([[Action("agg", 1)], [Action("agg", -1)]])

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, trust_env=False) as client:
            live = LiveDeployment(planner, client, interval_s=1.0, warmup_s=0.0)  # type: ignore[arg-type]
            await live.tick()
            [started] = live.outcomes[-1].detail["started"]
            await asyncio.to_thread(wait_for, server, state_is(started["name"], "serving"), VLLM_START_S)
            point = await asyncio.to_thread(_points, server, 2.0, time.time())
            registered = server.registry()
            await live.tick()
            return started, point, registered, live.outcomes[-1].detail["drained"]

    started, point, registered, drained = asyncio.run(scenario())
    name = started["name"]
    assert point["workers"]["agg"]["serving"] == 3, point["workers"]
    assert {w["worker_id"]: w["metadata"]["engine"] for w in registered}[name] == "vllm"
    assert [d["name"] for d in drained] == [name]  # the newest goes first
    wait_for(server, lambda listed: name not in listed or listed[name]["state"] not in ("draining", "serving"), 60)
    wait(lambda: not process_alive(started["pid"]), "the drained worker to exit", 30)
    assert all(w["worker_id"] != name for w in server.registry())


def test_a_killed_vllm_worker_stream_finishes_on_the_other_worker(vllm_deployment: Deployment, tokenizer: Tokenizer,
                                                                  reference: dict[str, Any]) -> None:
    ids, out = reference["kill"]
    server = vllm_deployment.server

    def kill() -> tuple[int, list[int], list[Path], list[str], list[str]]:
        def inspect(pid: int) -> tuple[list[int], list[Path], list[str], list[str]]:
            engine_core = _children(pid)
            titles = [title for title in map(_cmdline, engine_core) if title.startswith("VLLM::")]  # vLLM's own
            return engine_core, _scratch_of(pid), [_environ(p) for p in (pid, *engine_core)], titles

        pid, (engine_core, scratch, environs, titles) = kill_the_routed_worker(server, inspect)
        return pid, engine_core, scratch, environs, titles

    migrations = metric(server.url, "tokenmill_request_migrations_total")
    wait(lambda: metric(server.url, "tokenmill_router_worker_load_blocks") == 0, "the router's load back to zero")
    text, (killed, engine_core, scratch, environs, titles) = stream_with_a_kill(server.url, ids, KILL_TOKENS, kill,
                                                                                 KILL_AFTER_CHUNKS)
    assert text == text_of(tokenizer, ids, out)
    assert metric(server.url, "tokenmill_request_migrations_total") == migrations + 1
    assert engine_core, "the killed worker ran no vLLM engine core process"
    # on a CPU the model runs in the engine core's process, not in a worker of vLLM's multiprocess executor
    assert titles == ["VLLM::EngineCore"], f"the killed worker's vLLM processes: {titles}"
    # vLLM's processes run on vLLM's OpenMP defaults, not the own engine's tuning that serve set
    worker_env, *core_envs = environs
    assert "GOMP_SPINCOUNT=" in worker_env and not any("GOMP_SPINCOUNT=" in env for env in core_envs)
    wait(lambda: not any(process_alive(pid) for pid in engine_core), "the dead worker's vLLM processes to exit", 30)
    assert scratch, "the killed worker had no scratch directory (vLLM's sockets)"
    wait(lambda: not _scratch_of(killed), "serve to remove the killed worker's scratch directory", 30)


def _environ(pid: int) -> str:
    """The environment `pid` was started with (entries NUL-separated)."""
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")


def _cmdline(pid: int) -> str:
    """Its command line, or the title vLLM gives its processes."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


def _scratch_of(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"tokenmill-{pid}-*"))


def _children(pid: int) -> list[int]:
    """The processes `pid` started (vLLM's engine core, multiprocessing's resource tracker), transitively."""
    found = list(child_pids(pid))
    return found + [grandchild for child in found for grandchild in _children(child)]
