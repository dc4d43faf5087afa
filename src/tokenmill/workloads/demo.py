"""The dashboard's built-in loads as request builders: seeded, sized to the served model.

- **Risk synthesis** (prefill-heavy): each request is a long synthetic financial filing (its
  own: nothing shared) and a question for a short structured risk summary: long prompts, short
  answers, so prefill dominates and interferes with decode in an aggregated deployment.
- **Trial protocol** (agentic, shared corpus): eight agents (statistician, clinician, ...)
  discuss one long trial protocol over many turns. Each turn is the corpus, the agent's brief
  and its own conversation so far: the corpus is one prefix every turn shares, and each
  agent's history a prefix of its next turn. A device KV pool too small for every agent's
  context evicts them between turns; a managed cache (host tier) loads them back instead of
  recomputing them.
- **Trace replay**: a Mooncake JSONL or Azure CSV trace, its arrival times divided by a rate
  scale; each full block of a prompt comes from its chained block hash, so requests the trace
  says share a prefix share its tokens, and the server's prefix cache sees the same reuse.

Text sizes are in the served model's tokens: `count_tokens` (the frontend's tokenizer) measures
a draft once and the word count is scaled to the target.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenmill.workloads.prompt_synth import HashBlockSynth, RequestSpec, TokenSpace

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_WORDS = ("revenue margin liquidity covenant exposure hedge counterparty default spread tranche collateral "
          "maturity leverage coupon yield duration rating downgrade impairment goodwill provision reserve "
          "capital ratio basel liquidity stress scenario volatility currency commodity interest swap "
          "derivative notional settlement custody audit disclosure segment guidance outlook headwind").split()
_TRIAL_WORDS = ("randomised double-blind placebo cohort endpoint primary secondary efficacy safety adverse event "
                "dose titration inclusion exclusion criteria enrolment consent arm stratification interim "
                "analysis power sample hazard ratio confidence interval protocol amendment monitoring "
                "pharmacokinetic biomarker baseline follow-up visit withdrawal compliance site investigator").split()
AGENTS = ("statistician", "clinician", "regulatory reviewer", "safety officer", "pharmacologist",
          "ethics board member", "data manager", "patient advocate")


def words(rng: random.Random, vocabulary: tuple[str, ...] | list[str], count: int) -> str:
    """`count` words in sentences, with numbers, as a filing or a protocol reads."""
    out = []
    for i in range(count):
        word = rng.choice(vocabulary)
        out.append(f"{word} {rng.randint(1, 999)}.{rng.randint(0, 99):02d}%" if i % 11 == 5 else word)
        if i % 17 == 16:
            out[-1] += "."
    return " ".join(out)


def sized_text(rng: random.Random, vocabulary: list[str], tokens: int, count_tokens: Callable[[str], int]) -> str:
    """Text of about `tokens` of the served model's tokens."""
    seed = rng.random()
    draft = words(random.Random(seed), vocabulary, max(tokens, 16))
    per_word = max(count_tokens(draft), 1) / max(tokens, 16)
    return words(random.Random(seed), vocabulary, max(8, int(tokens / per_word)))


@dataclass(slots=True)
class DemoRequest:
    route: str
    body: dict[str, Any]
    agent: int | None = None  # trial: whose turn (one agent's turns never overlap)


class RiskSynthesis:
    def __init__(self, seed: int, count_tokens: Callable[[str], int], model: str, doc_tokens: int = 1500,
                 max_tokens: int = 64) -> None:
        self.rng = random.Random(seed)
        self.count_tokens, self.model = count_tokens, model
        self.doc_tokens, self.max_tokens = doc_tokens, max_tokens
        self.sent = 0

    def next(self, busy: set[int]) -> DemoRequest:
        self.sent += 1
        filing = sized_text(self.rng, _WORDS, self.doc_tokens, self.count_tokens)
        question = ("Summarise the three largest risks in this filing as JSON with keys risk, severity and "
                    "evidence. Be brief.")
        return DemoRequest(CHAT, {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0,
                                  "messages": [{"role": "system", "content": "You are a credit risk analyst."},
                                               {"role": "user", "content": f"Filing {self.sent}:\n{filing}\n\n"
                                                                           f"{question}"}]})


@dataclass(slots=True)
class _Agent:
    brief: str
    history: list[tuple[dict[str, str], int]] = field(default_factory=list)  # (message, its tokens)


class TrialProtocol:
    """`max_prompt_tokens` bounds a turn (the context length): an agent's oldest turns drop out of
    its history until the corpus, the history and the answer fit. The agents join mid-discussion:
    each starts with earlier turns filling `history_fill` of its room (a seeded transcript), so an
    agent's own context, not only the corpus, is long from the first turn: eight of them outgrow a
    small device KV pool, which is where a managed cache pays."""
    MESSAGE_OVERHEAD = 8  # tokens a chat template adds around each message, about
    PRIOR_ANSWER_TOKENS = 120

    def __init__(self, seed: int, count_tokens: Callable[[str], int], model: str, max_prompt_tokens: int,
                 corpus_tokens: int = 3000, max_tokens: int = 32, agents: int = len(AGENTS),
                 history_fill: float = 0.6) -> None:
        self.rng = random.Random(seed)
        self.count_tokens, self.model, self.max_tokens = count_tokens, model, max_tokens
        corpus = sized_text(self.rng, _TRIAL_WORDS, min(corpus_tokens, max_prompt_tokens // 2), count_tokens)
        self.system = f"You are one of {agents} reviewers of this trial protocol.\n\nPROTOCOL\n{corpus}"
        self.budget = max_prompt_tokens - max_tokens - count_tokens(self.system) - 2 * self.MESSAGE_OVERHEAD
        self.agents = [_Agent(f"You are the {AGENTS[i % len(AGENTS)]}.") for i in range(agents)]
        for agent in self.agents:
            self._earlier_turns(agent, history_fill * self.budget)
        self.turn = 0

    def _earlier_turns(self, agent: _Agent, tokens: float) -> None:
        while sum(n for _, n in agent.history) + 2 * self.PRIOR_ANSWER_TOKENS < tokens:
            question = f"{agent.brief} Earlier turn: what does section {self.rng.randint(1, 40)} imply for you?"
            answer = sized_text(self.rng, _TRIAL_WORDS, self.PRIOR_ANSWER_TOKENS, self.count_tokens)
            for message in ({"role": "user", "content": question}, {"role": "assistant", "content": answer}):
                agent.history.append((message, self.count_tokens(message["content"]) + self.MESSAGE_OVERHEAD))

    def next(self, busy: set[int]) -> DemoRequest | None:
        """The next agent's turn, round robin over the agents not waiting for an answer."""
        for _ in range(len(self.agents)):
            index = self.turn % len(self.agents)
            self.turn += 1
            if index not in busy:
                return self._turn_of(index)
        return None

    def _turn_of(self, index: int) -> DemoRequest:
        agent = self.agents[index]
        question = {"role": "user", "content": f"{agent.brief} Turn {len(agent.history) // 2 + 1}: what does "
                                               f"section {self.rng.randint(1, 40)} imply for you? Answer briefly."}
        agent.history.append((question, self.count_tokens(question["content"]) + self.MESSAGE_OVERHEAD))
        while len(agent.history) > 1 and sum(n for _, n in agent.history) > self.budget:
            del agent.history[:2]  # the oldest question and its answer
        messages = [{"role": "system", "content": self.system}, *(m for m, _ in agent.history)]
        return DemoRequest(CHAT, {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.0,
                                  "messages": messages}, agent=index)

    def answered(self, agent: int, text: str | None) -> None:
        """The agent's answer joins its history; a failed turn is asked again next time."""
        history = self.agents[agent].history
        if text is None:
            history.pop()
            return
        history.append(({"role": "assistant", "content": text}, self.count_tokens(text) + self.MESSAGE_OVERHEAD))


def scenario_specs(name: str, seed: int, rate: float, duration_s: float, encode_chat: Callable[[list], list[int]],
                   count_tokens: Callable[[str], int], context_length: int
                   ) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """A scenario's requests for `tokenmill bench demo`, fixed ahead, as (warm-up, measured): the
    measured ones at Poisson arrivals at `rate` over `duration_s` from `seed`, each prompt the chat
    template's token ids (`encode_chat`), so the live run and the fleet simulator's replay of it see
    the same tokens. The trial's warm-up is one turn of each agent (what a deployment in its steady
    state has seen: the measured turns are every agent's later ones); risk has none (nothing
    repeats). A trial agent's answers in its history are placeholder text of the answer's length
    (what a turn reuses is the corpus and the turns before, the same either way)."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    if name == "risk":
        source: RiskSynthesis | TrialProtocol = RiskSynthesis(seed, count_tokens, "", min(1500, context_length // 2))
    else:
        source = TrialProtocol(seed, count_tokens, "", context_length)
    warmup = len(source.agents) if isinstance(source, TrialProtocol) else 0
    specs = []
    for at in [None] * warmup + arrivals:
        request = source.next(set())
        if request is None:
            continue
        body = request.body
        specs.append(RequestSpec(encode_chat(body["messages"]), body["max_tokens"], arrival_s=at))
        if request.agent is not None and isinstance(source, TrialProtocol):
            source.answered(request.agent, words(rng, _TRIAL_WORDS, body["max_tokens"] // 2))
    return specs[:warmup], specs[warmup:]


def trace_requests(path: str, rate_scale: float, model: str, block_size: int, vocab_size: int,
                   max_model_len: int, max_output_tokens: int = 256) -> Iterator[tuple[float, DemoRequest]]:
    """(arrival second, request) of a trace file, arrivals divided by `rate_scale`; ValueError
    naming the field for a bad file or scale."""
    from tokenmill.sim.fleet.arrivals import load_trace

    if not rate_scale > 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    requests = load_trace(path, block_size=block_size, max_output_tokens=max_output_tokens,
                          max_input_tokens=max_model_len - max_output_tokens - 1)
    synth = HashBlockSynth(TokenSpace(vocab_size), block_size)
    for i, r in enumerate(requests):
        prompt = synth.prompt(r.block_hashes, r.input_tokens, i)
        yield r.arrival_s / rate_scale, DemoRequest(COMPLETIONS, {
            "model": model, "prompt": prompt, "max_tokens": max(1, r.output_tokens), "ignore_eos": True,
            "temperature": 0.0})
