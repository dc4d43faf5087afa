"""The engine: `add_request / step / abort`, synchronous, one step at a time.

Owns the scheduler, the KV cache manager (over the block pool) and a model
runner. A step schedules, runs the forward pass, appends sampled tokens, applies
stop conditions and returns one `RequestOutput` delta per request that advanced.
"""
from __future__ import annotations

import logging
import time

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.guided import Grammars, advance
from tokenmill.engine.kv_handoff import ImportPlan, KVHandoff
from tokenmill.engine.mock_runner import MockRunner
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import Request
from tokenmill.engine.runner_protocol import KVAllocator, ModelRunner, Sampled
from tokenmill.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.engine.speculative import Drafter
from tokenmill.engine.stats import EngineStats, StepCounters, request_blocks
from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.cache_manager import KVCacheManager
from tokenmill.kv.events import KVEventEmitter
from tokenmill.kv.hashing import block_hashes
from tokenmill.kv.union_events import UnionEvents
from tokenmill.textgen.model_config import ModelConfig, load_model_config
from tokenmill.textgen.outputs import FINISH_HANDOFF, FINISH_STOP, RequestOutput
from tokenmill.textgen.sampling import SamplingParams, TokenLogprob
from tokenmill.textgen.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, events: KVEventEmitter | None = None,
                 tokenizer: Tokenizer | None = None, load_tokenizer: bool = True,
                 kv_allocator: KVAllocator | None = None) -> None:
        self.config = config
        self.model_config: ModelConfig = load_model_config(config.model)
        if config.threads is not None and config.runner == "torch":
            import torch

            torch.set_num_threads(config.rank_threads)
        self.tokenizer = tokenizer or (Tokenizer(config.model) if load_tokenizer else None)
        num_blocks = config.kv_blocks(self.model_config)
        self.events = events or KVEventEmitter(config.worker_id)
        self.pools, self.kvs, self.schedulers = self._rank_schedulers(num_blocks)
        self.pool, self.kv, self.scheduler = self.pools[0], self.kvs[0], self.schedulers[0]
        self.max_model_len = self._max_model_len(num_blocks)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else frozenset(self.model_config.eos_token_ids)
        self.output = OutputProcessor(self.tokenizer, eos, self.max_model_len)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, sorted(eos))
        # the draft model first: a bad one fails before a parallel worker's ranks start
        self.drafter = Drafter(config.speculative, self.max_model_len, self._draft_model(num_blocks))
        self.runner: ModelRunner = self._make_runner(num_blocks, kv_allocator)
        self.handoff = KVHandoff(self.scheduler, self.kv)
        self.tiers = self._attach_tiers() if config.kv_tiers_enabled else None
        self.requests: dict[str, Request] = {}
        self.counters = StepCounters()

    def _rank_schedulers(self, num_blocks: int) -> tuple[list[BlockPool], list[KVCacheManager], list[Scheduler]]:
        """A block pool, its KV manager and a scheduler per attention data-parallel rank (one
        without --attention-dp); the ranks' pools announce their blocks as one worker's."""
        config, ranks = self.config, max(1, self.config.attention_dp)
        union = UnionEvents(self.events) if ranks > 1 else None
        pools = [BlockPool(num_blocks, config.block_size, self.events if union is None else union.view(r),
                           config.enable_prefix_caching) for r in range(ranks)]
        kvs = [KVCacheManager(pool, config.hash_seed) for pool in pools]
        budget = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens)
        return pools, kvs, [Scheduler(budget, kv) for kv in kvs]

    def _attach_tiers(self):
        from tokenmill.engine.kv_tiers_wiring import attach_tiers  # torch: tiers copy real KV

        return attach_tiers(self)

    def _max_model_len(self, num_blocks: int) -> int:
        limit = min(self.model_config.max_position_embeddings, num_blocks * self.config.block_size)
        if self.model_config.sliding_window:
            limit = min(limit, self.model_config.sliding_window)
        if self.config.max_model_len is not None:
            if self.config.max_model_len > limit:
                raise ValueError(f"max_model_len {self.config.max_model_len} exceeds what the model and "
                                 f"KV pool allow ({limit})")
            limit = self.config.max_model_len
        return limit

    def _make_runner(self, num_blocks: int, kv_allocator: KVAllocator | None) -> ModelRunner:
        cfg = self.model_config
        if self.config.runner == "mock":
            specials = self.tokenizer.special_token_ids if self.tokenizer else frozenset()
            return MockRunner(self.config.mock_step_time, cfg.vocab_size, specials, self.config.mock_sleep,
                              self.config.mock_speedup)
        from tokenmill.engine.decode_graphs import graph_shapes
        from tokenmill.engine.runner import TorchModelRunner  # torch: only for a real forward pass
        from tokenmill.engine.weights import load_model

        choice = self.config.dtype_choice(cfg)
        if choice.reason:
            log.info("--dtype auto: %s, %s", choice.dtype, choice.reason)
        dtype = self.config.torch_dtype(cfg)
        if self.config.tp != 1 or self.config.ep != 1 or self.config.attention_dp != 1:  # (below 1: refused)
            from tokenmill.engine.parallel.start import parallel_runner

            return parallel_runner(self.config, cfg, dtype, num_blocks, self.max_model_len, kv_allocator)
        if kv_allocator is not None and self.config.device != "cpu":
            raise ValueError(f"--device {self.config.device}: KV transfer between workers reads a host-memory "
                             "pool; disaggregated roles run on the CPU for now")
        c = self.config
        model = load_model(c.model, cfg, dtype, self.max_model_len, device=c.device, batch_invariant=c.deterministic)
        return TorchModelRunner(model, cfg, num_blocks, c.block_size, dtype, c.seed, kv_allocator, c.device,
                                graph_shapes(c, cfg, self.max_model_len), c.deterministic)

    def _draft_model(self, num_blocks: int):
        spec = self.config.speculative
        if spec is None or spec.draft_model is None:
            return None
        from tokenmill.engine.draft_model import DraftModel  # torch: a second model's forward pass

        config = self.config  # one pool for the requests of every attention-DP rank
        return DraftModel.load(spec.draft_model, config.torch_dtype(self.model_config),
                               num_blocks * len(self.schedulers), config.block_size, self.max_model_len,
                               config.max_num_batched_tokens, config.device)

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    extra_key: str | None = None, output_offset: int = 0, text_pending: int = 0,
                    prefill_only: bool = False) -> None:
        """Queue a request. `output_offset` continues a migrated request: its prompt already
        ends with that many generated tokens, and seeded sampling resumes at that index;
        `text_pending` of them still owe the client their text. A `prefill_only` request ends
        after its first token with FINISH_HANDOFF and holds its KV until `release_held`."""
        if prefill_only:
            self._check_handoff()
        request = self._new_request(request_id, prompt_token_ids, params, extra_key, output_offset, text_pending)
        request.prefill_only = prefill_only
        request.dp_rank = self._place(request)
        self._scheduler_of(request).add(request)

    def begin_import(self, request_id: str, token_ids: list[int], params: SamplingParams,
                     extra_key: str | None = None, output_offset: int = 1, text_pending: int = 0,
                     ) -> ImportPlan | None:
        """Admit a request whose KV for every position but the last was computed elsewhere
        (`token_ids` = prompt + the sampled first token, `output_offset` >= 1). Returns where the
        remote blocks must be copied, then `finish_import`; or None when the pool is full, and
        the request is simply queued to be prefilled here."""
        if output_offset < 1:
            raise ValueError("an imported request continues after the token its prefill sampled")
        self._check_handoff()
        request = self._new_request(request_id, token_ids, params, extra_key, output_offset, text_pending)
        plan = self.handoff.begin_import(request)
        if plan is None:
            self.scheduler.add(request)
        return plan

    def finish_import(self, request_id: str, ok: bool) -> bool:
        """The KV of a `begin_import` arrived intact (decode next) or did not (recompute here)."""
        return self.handoff.finish_import(request_id, ok)

    def _check_handoff(self) -> None:
        if len(self.schedulers) > 1:
            raise ValueError("--attention-dp: disaggregated KV handoff does not work with attention data "
                             "parallelism yet (each rank holds its own KV)")

    def release_held(self, request_id: str) -> bool:
        """Free the KV a prefill-only request held; False when it holds none."""
        if not self.handoff.release(request_id):
            return False
        self.requests.pop(request_id, None)
        return True

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     extra_key: str | None, output_offset: int, text_pending: int) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        self._validate_prompt(prompt_token_ids)
        vocab = self.model_config.vocab_size
        if any(token >= vocab for token in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        request = Request(request_id, list(prompt_token_ids), params, extra_key, output_offset,
                          min(max(text_pending, 0), output_offset))
        if params.grammar is not None:
            replay = prompt_token_ids[len(prompt_token_ids) - output_offset:] if output_offset else ()
            request.matcher = self.grammars.matcher(params.grammar, replay)
        self.requests[request_id] = request
        self.output.add(request)
        return request

    def _validate_prompt(self, prompt: list[int]) -> None:
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty list of token ids")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; the context length is {self.max_model_len} "
                             "(and at least one token must be generated)")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")

    def abort(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if not self.handoff.abort(request_id):
            self._scheduler_of(request).abort(request)
        self.output.remove(request_id)
        self.drafter.release(request_id)
        return True

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    def _scheduler_of(self, request: Request) -> Scheduler:
        return self.schedulers[request.dp_rank]

    def _place(self, request: Request) -> int:
        """The attention data-parallel rank for a new request: the least cost in blocks, where a
        rank's cost is the prompt blocks it would have to compute (those its pool does not
        hold) plus the blocks its own requests hold or will need (as the router weighs a
        worker); ties go to the lowest rank. A cached prefix draws a request to its rank only
        while that rank is not the more loaded by more than the prefix saves."""
        if len(self.schedulers) == 1:
            return 0
        bs = self.config.block_size
        tokens = request.token_ids[:(len(request.token_ids) - 1) // bs * bs]
        hashes = block_hashes(tokens, bs, self.config.hash_seed, extra_key=request.extra_key)
        prompt_blocks = -(-len(request.token_ids) // bs)

        def cost(rank: int) -> int:
            pool, cached = self.pools[rank], 0
            while cached < len(hashes) and pool.lookup(hashes[cached], tokens[cached * bs:(cached + 1) * bs]):
                cached += 1
            scheduler = self.schedulers[rank]
            load = sum(-(-r.num_tokens // bs) - r.num_cached_tokens // bs
                       for r in (*scheduler.running, *scheduler.waiting))
            return prompt_blocks - cached + load
        return min(range(len(self.schedulers)), key=cost)

    def cached_hashes(self) -> list[int]:
        """The chained hashes of every block in the device prefix cache (a KV snapshot)."""
        if len(self.pools) == 1:
            return self.pool.cached_hashes()
        return list({h: None for pool in self.pools for h in pool.cached_hashes()})

    def set_tiers_enabled(self, enabled: bool) -> bool:
        """Use the KV tiers below the device pool, or not (False without tiers: nothing to switch)."""
        if self.tiers is None:
            return False
        self.tiers.enabled = enabled
        return True

    def pin_prefix(self, token_ids: list[int]) -> bool:
        """Pin the full blocks of a prefix in every KV tier (False when a tier's pin cap is
        reached or the prefix has no full block); engine thread only."""
        if self.tiers is None:
            raise ValueError("pinning needs a KV tier (--kv-host-gb, --kv-disk-dir or --kv-shared)")
        self._validate_prompt(token_ids)
        return self.tiers.pin_prefix(token_ids)

    def close(self) -> None:
        """Finish queued KV offloads and release the tiers; stop a parallel runner's ranks."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        self.runner.close()

    # -- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outs = [scheduler.schedule() for scheduler in self.schedulers]
        self.counters.preemptions += sum(len(out.preempted) for out in outs)
        for request_id in (r for out in outs for r in out.preempted):
            self.drafter.release(request_id)  # its draft K/V too: the pool is short
        if not any(outs):
            return []
        t0 = time.perf_counter()
        if len(outs) == 1:
            sampled = self.runner.execute(outs[0], self.kv)
        else:  # attention data parallel: every rank steps together, idle ones included
            sampled = self.runner.execute_ranks(outs, self.kvs)  # type: ignore[attr-defined]
        self.counters.record_step(outs, self.runner.step_seconds(time.perf_counter() - t0))
        results = []
        for scheduler, out in zip(self.schedulers, outs):
            results += self._process(scheduler, out, sampled)
        if self.config.speculative is not None:  # nothing built for drafts without speculation
            decoding = [s.request for out in outs for s in out.seqs
                        if s.request.request_id in sampled and not s.request.is_finished]
            self.drafter.propose(decoding, self.requests)
        return results

    def _process(self, scheduler: Scheduler, out: SchedulerOutput, sampled: Sampled) -> list[RequestOutput]:
        """Each sequence's step recorded; an output for each that sampled (in step order)."""
        results = []
        for seq in out.seqs:
            rows = sampled.get(seq.request.request_id)
            if rows is None:  # a prompt chunk short of the prompt's end
                scheduler.advance(seq)
                continue
            results.append(self._emit(scheduler, seq, rows))
        return results

    def _emit(self, scheduler: Scheduler, seq: ScheduledSeq, rows: list[tuple[int, TokenLogprob | None]]
              ) -> RequestOutput:
        """Append the step's tokens (the drafts the target confirmed, then its own next token),
        each checked for a stop as if it had been decoded alone; record the step; finish the
        request if it stopped."""
        request = seq.request
        accepted = self.drafter.verify(request, seq.num_drafts, rows)
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        text, stop = "", None
        for token, logprob in rows[:accepted + 1]:
            request.append_token(token, logprob)
            tokens.append(token)
            logprobs += [logprob] if logprob is not None else []
            stop, delta = self._check_stop(request, token)
            text += delta
            if stop is not None:
                break
        scheduler.advance(seq)
        pending = self.output.pending_tokens(request.request_id)
        if stop is None and request.prefill_only:
            return self._hand_off(request, tokens[-1], text, logprobs[-1] if logprobs else None, pending)
        if stop is not None:
            reason, stop_token = stop
            if stop_token is not None:
                request.stop_reason = stop_token
            scheduler.finish(request, reason)
            self.output.remove(request.request_id)
            del self.requests[request.request_id]
        return RequestOutput(
            request.request_id, tokens, text, request.is_finished, request.finish_reason,
            request.num_prompt_tokens, len(request.output_token_ids), request.num_cached_tokens,
            logprobs, request.stop_reason, pending, step_seconds=request.take_step_seconds(),
        )

    def _check_stop(self, request: Request, token: int) -> tuple[tuple[str, int | None] | None, str]:
        """(stop or None, the token's new text) after appending `token`."""
        stop = self.output.check_token_stop(request, token)
        if request.matcher is not None and advance(request.matcher, token) and stop is None:
            stop = (FINISH_STOP, None)  # the grammar is complete: nothing but EOS could follow
        text, matched = self.output.text_delta(request, [token], finished=stop is not None)
        if stop is None and matched is not None:
            stop = (FINISH_STOP, None)
            request.stop_reason = matched
        return stop, text

    def _hand_off(self, request: Request, token: int, text: str, logprob: TokenLogprob | None,
                  pending: int) -> RequestOutput:
        """End a prefill-only request after its first token, keeping its blocks held. If any of
        the token's text is held back, none is emitted here: the decode worker re-detokenizes
        the token (`text_pending`), so its text and stop-string checks continue seamlessly."""
        if self.output.holds_text(request.request_id):
            text, pending = "", len(request.output_token_ids)
        self.scheduler.finish(request, FINISH_HANDOFF, free_kv=False)
        self.output.remove(request.request_id)
        blocks = self.handoff.hold(request.request_id)
        return RequestOutput(
            request.request_id, [token], text, True, FINISH_HANDOFF, request.num_prompt_tokens,
            len(request.output_token_ids), request.num_cached_tokens,
            [logprob] if logprob is not None else [], None, pending, blocks, request.take_step_seconds(),
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion in one batch; the output token ids of each, in order."""
        ids = [f"gen-{self.counters.steps}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params)
        done: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in done:
                    done[out.request_id].extend(out.new_token_ids)
        return [done[rid] for rid in ids]

    def stats(self) -> EngineStats:
        """A consistent view only on the engine's own thread (AsyncLLMEngine.stats)."""
        c = self.counters
        held = request_blocks((r for s in self.schedulers for r in (*s.running, *s.waiting)), self.config.block_size)
        free, total = sum(p.num_free_blocks for p in self.pools), sum(p.num_blocks for p in self.pools)
        queried = sum(kv.stats.queried_tokens for kv in self.kvs)
        hits = sum(kv.stats.hit_tokens for kv in self.kvs)
        return EngineStats(
            num_running=sum(len(s.running) for s in self.schedulers),
            num_waiting=sum(len(s.waiting) for s in self.schedulers),
            kv_usage=1.0 - free / total, num_free_blocks=free, num_blocks=total,
            prefix_hit_rate=hits / queried if queried else 0.0,
            num_steps=c.steps, prefill_tokens=c.prefill_tokens, decode_tokens=c.decode_tokens,
            prefill_step_seconds=c.prefill_seconds, decode_step_seconds=c.decode_seconds,
            num_decode_only_steps=c.decode_only_steps, num_preemptions=c.preemptions, request_blocks=held,
            onboarded_tokens=self.kv.stats.onboarded_tokens, queried_tokens=queried, device_hit_tokens=hits,
            num_held=len(self.handoff.held), num_importing=len(self.handoff.importing),
            spec_draft_tokens=self.drafter.drafted, spec_accepted_tokens=self.drafter.accepted,
            tier_stats=self.tiers.stats() if self.tiers is not None else {},
        )
