"""The ``agent`` workload: coding-agent sessions shaped by measured field data (issue 27, item 1).

One script is one developer's session with one coding CLI (Claude Code, Codex, OpenCode or
Cline), sent as OpenAI chat completions with an ``x-session-id`` header. One module of ~780
lines on purpose: every parameter, its source and the generator that uses it are read together.

- the client's **fixed prefix** (system prompt + tool schemas), identical text and token ids in
  every session of that client, then a per-session **preamble** (environment, git status,
  AGENTS.md) in front of the first user message;
- **user requests**, each a chain of **model calls**: the first answers the user's message, the
  next ones each a tool result. Every call's prompt is the previous call's prompt + the
  previous call's output + the new message, so consecutive prompts share their prefix exactly;
- a **tool gap** (``Think``) before each tool-triggered call and a **human gap** before each
  user request after the first;
- **compaction** at the client's threshold: a summarisation call on the whole context, after
  which the prompt is the fixed prefix + preamble + the summary (+ Codex's kept user messages):
  a cache miss past the preamble;
- **sub-agent groups**: a main call's answer sometimes runs 1..4 sub-agents whose prompts start
  with the parent's fixed prefix (+ a task); the parent waits for all and reads their answers.
  They are sent as *parallel Sends in lockstep rounds*: each round sends the next call of every
  sub-agent still at work and waits for them all, then the longest of their tool gaps. The
  script protocol (Send resumes when all of its jobs are done) has no independent timelines
  inside one script; lockstep keeps what the field data measures (concurrent sub-agents, all
  sharing the prefix, the parent joining them) and only makes a fast sub-agent wait for the
  round's slowest one, which a real one would not;
- **side calls**: with each user request's first call, one small call with its own short system
  prompt (title / topic generation), sent in the same Send.

Every parameter is in :class:`AgentParams` and :data:`CLIENTS` below, each with its source.
"TraceLab" there is uw-syfi/TraceLab (arXiv 2606.30560): 4,265 real Claude Code and Codex
sessions, 357,161 LLM calls, 43 developers, hosted frontier models.

Deterministic by seed: session ``i`` draws its structure (client, sizes, gaps, counts) from one
RNG seeded by (seed, "agent", i) and its words from a second one, so neither the text nor a
server's answer changes the structure. :func:`checks` generates sessions without running them
and measures what the field data measured (``python3 -m gateway.bench.agent`` prints them).

Text and ids: one pseudo-word is one token (as in the other workloads); a segment's text and
ids are a slice of one shared pseudo-text, so a call's prompt is built by concatenating slices
(no per-token Python work) and its ``prompt_ids`` are exactly the words of its messages.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import random
import statistics
import sys
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from gateway.bench.workloads import Job, Outcome, Script, Send, Think, Workload, words

# ============================ the parameters, each with its source ============================


@dataclass(frozen=True)
class LogNormal:
    """``median * exp(N(0, sigma))`` clamped to [low, high]."""

    median: float
    sigma: float
    low: float
    high: float

    def draw(self, rng: random.Random) -> float:
        return min(self.high, max(self.low, self.median * math.exp(rng.gauss(0.0, self.sigma))))

    def draw_int(self, rng: random.Random) -> int:
        return int(min(self.high, max(self.low, round(self.median * math.exp(rng.gauss(0.0, self.sigma))))))


# The served model's context window: Qwen3.5-122B-A10B's context_length (the simulator's
# profiles, gateway/sim/profiles/default.yaml). A client that reads the model's window
# compacts relative to it; no prompt plus output may exceed it.
WINDOW_TOKENS = 262_144


@dataclass(frozen=True)
class Client:
    """One coding CLI: what every session of it shares, and when it compacts."""

    name: str
    weight: float  # share of sessions
    prefix_tokens: int  # fixed prefix: system prompt + tool schemas, shared by all its sessions
    compact_at: int  # input tokens at which the client compacts the context
    output_median: int  # output tokens per call, median
    keep_user_tokens: int = 0  # user messages kept verbatim after a compaction


CLIENTS = (
    # Fixed prefix ~16k: per trace tool_tokens ~12.3-13.0k + system_tokens ~2.8-4.3k (HF dataset
    # semianalysisai/cc-traces-weka-042026; ~19k in hpfreilabs.com "Anatomy of a Claude Code
    # session"). Compaction at the effective window - 13k, ~167k of a 200k window (claude-code
    # issue #31806, ccstatusline #319); the override can only lower it, and 200k is the window
    # it assumes for a model it does not know (assumption). Output median 252 (TraceLab
    # output_tokens, Claude).
    Client("claude-code", 0.50, 16_000, 167_000, 252),
    # Fixed prefix ~10k: 11.4k / 11.2k input tokens for "hi", mostly tool descriptions
    # (anomalyco/opencode #8984, #1393, #2752; 7.6k on llama.cpp). Compaction at the input limit
    # - min(20k, max output) (opencode session/overflow.ts), the model's max output being
    # above 20k. Output median 220: between Claude's and Codex's (assumption).
    Client("opencode", 0.20, 10_000, WINDOW_TOKENS - 20_000, 220),
    # Fixed prefix ~6k: instructions 8.2k chars (gpt_5_codex_prompt.md, ~2k tokens) to 22.3k
    # chars (prompt.md, ~5.6k tokens) plus tool schemas (openai/codex codex-rs/core/*.md).
    # Compaction at 90 % of the window (codex-rs openai_models.rs; 272k -> ~245k for its own
    # models, here the served model's window), keeping <= 20k tokens of user messages
    # (codex-rs compact.rs). Output median 184 (TraceLab output_tokens, Codex).
    Client("codex", 0.15, 6_000, int(0.9 * WINDOW_TOKENS), 184, keep_user_tokens=20_000),
    # Fixed prefix ~10k: 10,136 tokens for a hello-world task (cline/cline #3664; "~15k" in
    # #1507). Compaction at max(W - 40k, 0.8 W) for a window W above 200k (cline
    # context-window-utils.ts). Output median 220 (assumption, as OpenCode).
    Client("cline", 0.15, 10_000, max(WINDOW_TOKENS - 40_000, int(0.8 * WINDOW_TOKENS)), 220),
)
# The mix (weights above) is an assumption: no source counts sessions per CLI.


@dataclass(frozen=True)
class AgentParams:
    clients: tuple[Client, ...] = CLIENTS
    # Per-session preamble (environment, git status, AGENTS.md), unshared: assumption
    # (median 2k, sigma 1.0).
    preamble: LogNormal = LogNormal(2_000, 1.0, 200, 20_000)
    # User requests per session: max(1, round(LogNormal(1, 2.1))): p50 1, p90 15, p99 132, mean 9
    # against TraceLab session_internal_counts avg 9.2, p50 1, p90 18, p99 137. The cap (1,000)
    # is near the largest Claude Code trace (1,178 requests, cc-traces-weka-042026 card).
    requests: LogNormal = LogNormal(1, 2.1, 1, 1_000)
    # Model calls per request: max(1, round(LogNormal(2, 1.7))): p50 2, p90 18, p99 104, mean
    # 8.5 against TraceLab's avg 8.8 (1 + 7.8 tool-triggered; tool-triggered p50 1, p90 20,
    # p99 86).
    calls: LogNormal = LogNormal(2, 1.7, 1, 1_000)
    # Output per call: LogNormal(client median, 1.3): the sigma makes the mix's mean ~510,
    # TraceLab's 186.9M output tokens / 357,161 calls = 523, with p90 ~1.1k (TraceLab: p90
    # < 1.7k). Capped at 8k so that a compaction call still fits the window.
    output_sigma: float = 1.3
    output_cap: int = 8_192
    # What each call appends after the previous output: the user's message or the tool result
    # (the sub-agents' answers after a group). Fitted, with the previous output, to TraceLab's
    # prefix_append_distribution: new tokens per call median 857 (Claude) / 886 (Codex), and
    # to the context growth per call, +1.7-1.8k (TraceLab total_input_growth; +2.2k for Codex
    # on SWE-bench Pro, vLLM blog 2026-05-06 "vLLM x Mooncake"). Capped at 32k.
    append: LogNormal = LogNormal(410, 1.42, 1, 32_000)
    # Tool time before a tool-triggered call, fitted to TraceLab session_timing_distribution
    # per call: p50 0.1 s, p90 10 s (sigma = ln(100) / 1.2816); it gives 3.8 % over 1 min
    # (TraceLab: 4 % of tool calls) but p99 7 min (TraceLab 3.2 min); capped at 600 s
    # (assumption), which makes the mean 12 s (TraceLab 16.8 s).
    tool_gap_s: LogNormal = LogNormal(0.1, math.log(100) / 1.2816, 0.0, 600.0)
    # Human think time before each user request after the first, fitted to TraceLab
    # human_input_wait: p50 ~86 s, p90 ~21 min (sigma = ln(1260 / 86) / 1.2816); it gives 28 %
    # over 5 min (TraceLab 20 % Claude / 30 % Codex) but p99 3.1 h (TraceLab ~14 h). Capped at a
    # day (assumption: an idler session is a new one).
    human_gap_s: LogNormal = LogNormal(86.0, math.log(1260 / 86) / 1.2816, 0.0, 86_400.0)
    human_scale: float = 1.0  # bench option: compress the human gaps (1 = as measured)
    # Compaction: the client asks the model for a summary of the whole context (Claude Code's
    # auto-compact, codex-rs compact.rs); the summary's size ~U(2k, 8k) and the instruction's
    # 300 tokens are assumptions.
    summary_tokens: tuple[int, int] = (2_000, 8_000)
    compact_prompt_tokens: int = 300
    # Sub-agents (Claude Code, cc-traces-weka-062126 via a third-party audit: 56,798 main +
    # 42,029 sub-agent requests in 1,697 groups): 3 % of main calls spawn a group, ~25 requests
    # per group, 43 % of requests. A call that ends its request has nothing to spawn, so the
    # probability applies to the other calls (~88 % of them): 0.034 makes it 3 % of all.
    # Group size uniform 1..4 (assumption; Claude Code caps concurrent sub-agents at 20,
    # claude-code #73438); each starts from the parent's fixed prefix (sub-agents reuse the
    # parent's system prompt + tools, hpfreilabs) + a ~1k task (assumption), and makes
    # LogNormal(7.3, 0.8) calls, mean 10, so a group averages 2.5 x 10 = 25 requests.
    # Measured on Claude Code; applied to every client (assumption).
    subagent_prob: float = 0.034
    subagent_group: tuple[int, int] = (1, 4)
    subagent_task: LogNormal = LogNormal(1_000, 0.5, 100, 8_000)
    subagent_calls: LogNormal = LogNormal(7.3, 0.8, 1, 200)
    # Side calls (assumption, no trace counts them): one small call per user request (title /
    # topic generation) with its own short system prompt, input ~500, output ~20: a 250-token
    # system prompt fixed per client + the head (<= 250 tokens) of the user's message.
    side_calls: bool = True
    side_system_tokens: int = 250
    side_user_tokens: int = 250
    side_output_tokens: int = 20
    temperature: float = 0.7  # as the chat and agentic workloads


PARAMS = AgentParams()

# ====================================== pseudo-text =========================================


class Seg(NamedTuple):
    """A run of pseudo-words: its text and its token ids (one per word)."""

    text: str
    ids: tuple[int, ...]


EMPTY = Seg("", ())
POOL_TOKENS = 1 << 18  # larger than any segment (the largest: a 32k message)


@functools.cache
def _pool() -> tuple[str, tuple[int, ...], list[int]]:
    """One long pseudo-text (fixed, independent of the seed), its ids and each word's offset."""
    text, ids = words(random.Random("agent:pool"), POOL_TOKENS)
    starts = [0, *itertools.accumulate(len(w) + 1 for w in text.split(" "))]
    return text, ids, starts


def segment(rng: random.Random, n: int) -> Seg:
    """``n`` pseudo-words: a slice of the pool at a random offset."""
    if n <= 0:
        return EMPTY
    text, ids, starts = _pool()
    at = rng.randrange(POOL_TOKENS - n + 1)
    return Seg(text[starts[at]:starts[at + n] - 1], ids[at:at + n])


def join(segs: Sequence[Seg]) -> Seg:
    segs = [s for s in segs if s.ids]
    return Seg(" ".join(s.text for s in segs), tuple(itertools.chain.from_iterable(s.ids for s in segs)))


def head(seg: Seg, n: int) -> Seg:
    return seg if len(seg.ids) <= n else Seg(" ".join(seg.text.split(" ", n)[:n]), seg.ids[:n])


def tail(seg: Seg, n: int) -> Seg:
    if n <= 0:
        return EMPTY
    return seg if len(seg.ids) <= n else Seg(" ".join(seg.text.split(" ")[-n:]), seg.ids[-n:])


@functools.cache
def client_prefix(name: str, tokens: int) -> Seg:
    """The client's fixed prefix: the same text and ids in every session (and every seed)."""
    text, ids = words(random.Random(f"agent:prefix:{name}"), tokens)
    return Seg(text, ids)


@functools.cache
def side_prefix(name: str, tokens: int) -> Seg:
    text, ids = words(random.Random(f"agent:side:{name}"), tokens)
    return Seg(text, ids)


# ====================================== the sessions ========================================

# What a generated call was, for checks(): "user" (a request's first call), "tool" (a main
# call after a tool), "compact", "sub" (a sub-agent's), "side".
# "group" (a sub-agent group starts; no job).
Trace = Callable[[str, object, Job | None], None]
Calls = Generator[Send | Think, list[Outcome] | None, list[Outcome]]


class _Thread:
    """One conversation with the model (the main agent's, or one sub-agent's): its messages,
    their ids, and what comes before its next call."""

    def __init__(self, system: Seg, lead: Seg, client: Client, materialize: bool = True) -> None:
        self.system, self.lead, self.client = system, lead, client
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system.text}]
        # ``materialize=False`` (checks() only): the prompt's size without its ids, which are a
        # copy of the whole context per call.
        self.materialize = materialize
        self.ids = system.ids if materialize else ()
        self.size = len(system.ids)
        self.fresh = True  # the lead goes in front of the next user message
        self.pending: list[tuple[str, Seg]] = []
        self.typed: list[Seg] = []  # the user's own messages (a Codex compaction keeps them)
        # How many leading tokens of ``ids`` the thread's previous prompt had (checks() counts
        # them as hits; its exact mode verifies them): all of it, but after a compaction only
        # the fixed prefix and the lead.
        self.reused = 0
        self._keeps: int | None = 0  # no previous prompt before the first

    def add(self, role: str, seg: Seg, typed: bool = False) -> None:
        if seg.ids:
            self.pending.append((role, seg))
        if typed:
            self.typed.append(seg)

    def next_size(self) -> int:
        lead = len(self.lead.ids) if self.fresh else 0
        return self.size + lead + sum(len(s.ids) for _, s in self.pending)

    def needs_compaction(self) -> bool:
        return self.next_size() >= self.client.compact_at

    def _flush(self, entries: list[tuple[str, Seg]]) -> None:
        self.reused = self.size if self._keeps is None else self._keeps
        self._keeps = None
        added = []
        for role, seg in entries:
            if role == "user" and self.fresh:
                seg, self.fresh = join([self.lead, seg]), False
            self.messages.append({"role": role, "content": seg.text})
            added.append(seg.ids)
        self.size += sum(map(len, added))
        if self.materialize:
            self.ids += tuple(itertools.chain(*added))  # one copy of the prompt per call

    def flush(self) -> None:
        self._flush(self.pending)
        self.pending = []

    def flush_for_compaction(self, instruction: Seg) -> None:
        """Everything but the trailing user message (it comes after the summary), then the
        instruction to summarise."""
        keep = len(self.pending)
        while keep and self.pending[keep - 1][0] == "user":
            keep -= 1
        self._flush([*self.pending[:keep], ("user", instruction)])
        self.pending = self.pending[keep:]

    def compacted(self, summary: Seg) -> None:
        """The context is now the fixed prefix, the lead and the summary (+ kept user text)."""
        kept, budget = [], self.client.keep_user_tokens
        for seg in reversed(self.typed):
            if budget <= 0:
                break
            kept.append(tail(seg, budget))
            budget -= len(seg.ids)
        first = join([self.lead, summary, *reversed(kept)])
        self.messages = [{"role": "system", "content": self.system.text},
                         {"role": "user", "content": first.text}]
        self.ids = self.system.ids + first.ids if self.materialize else ()
        self.size = len(self.system.ids) + len(first.ids)
        self.fresh = False
        self._keeps = len(self.system.ids) + len(self.lead.ids)


class Agent(Workload):
    """Coding-agent sessions from the field data: see the module docstring."""

    name = "agent"

    def __init__(self, seed: int = 0, max_tokens: int | None = None,
                 params: AgentParams = PARAMS, client: str | None = None) -> None:
        super().__init__(seed, max_tokens)
        self.params = params
        names = [c.name for c in params.clients]
        if client is not None and client not in names:
            raise ValueError(f"unknown agent client {client!r}: one of {', '.join(names)}")
        self.client = client

    def script(self, index: int) -> Script:
        return self.session(index)

    def pick(self, rng: random.Random) -> Client:
        clients = self.params.clients
        draw = rng.random() * sum(c.weight for c in clients)  # drawn always: same stream either way
        if self.client is not None:
            return next(c for c in clients if c.name == self.client)
        for c in clients:
            draw -= c.weight
            if draw < 0:
                return c
        return clients[-1]

    def session(self, index: int, trace: Trace | None = None, materialize: bool = True) -> Script:
        """Session ``index``; ``trace`` hears of every call, ``materialize=False`` leaves the
        main and sub-agent prompts' ids out (their sizes stay: for checks())."""
        p = self.params
        rng = self.rng(index)
        text = random.Random(f"{self.seed}:{self.name}:{index}:text")
        client = self.pick(rng)
        sid = f"agent-{self.seed}-{index}"
        s = _Session(self, client, sid, rng, text, trace, materialize)
        main = _Thread(client_prefix(client.name, client.prefix_tokens),
                       segment(text, p.preamble.draw_int(rng)), client, materialize)
        for request in range(p.requests.draw_int(rng)):
            if request:
                yield Think(p.human_gap_s.draw(rng) * p.human_scale)
            calls = p.calls.draw_int(rng)
            message = segment(text, p.append.draw_int(rng))
            main.add("user", message, typed=True)
            side = [s.side_job(message)] if p.side_calls else []
            for call in range(calls):
                yield from s.call([main], ["user" if call == 0 else "tool"], side)
                side = []
                if call == calls - 1:
                    break
                if rng.random() < p.subagent_prob:
                    main.add("user", (yield from s.subagents()))
                else:
                    yield Think(p.tool_gap_s.draw(rng))
                    main.add("user", segment(text, p.append.draw_int(rng)))


class _Session:
    """What the calls of one session share: its client, headers, RNGs, the trace."""

    def __init__(self, agent: Agent, client: Client, sid: str, rng: random.Random,
                 text: random.Random, trace: Trace | None, materialize: bool) -> None:
        self.agent, self.p, self.client, self.sid = agent, agent.params, client, sid
        self.rng, self.text, self.trace, self.materialize = rng, text, trace, materialize
        self.headers = {"x-session-id": sid}

    def job(self, messages: list[dict[str, str]], ids: tuple[int, ...], out: int,
            size: int | None = None) -> Job:
        out = max(1, min(self.agent.cap(out), WINDOW_TOKENS - (len(ids) if size is None else size)))
        body = {"messages": messages, "max_tokens": out, "temperature": self.p.temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        return Job("/v1/chat/completions", body, dict(self.headers), ids, out, session=self.sid)

    def emit(self, kind: str, owner: object, job: Job) -> Job:
        if self.trace is not None:
            self.trace(kind, owner, job)
        return job

    def note(self, kind: str) -> None:
        if self.trace is not None:
            self.trace(kind, None, None)

    def answer(self, outcome: Outcome) -> Seg:
        """A call's answer as the next prompt's text: the server's text (over HTTP) or
        pseudo-words; ids synthesised either way (one per output token)."""
        seg = segment(self.text, outcome.tokens)
        return Seg(outcome.text, seg.ids) if outcome.text and seg.ids else seg

    def output_len(self) -> int:
        p = self.p
        return LogNormal(self.client.output_median, p.output_sigma, 1, p.output_cap).draw_int(self.rng)

    def side_job(self, message: Seg) -> Job:
        p = self.p
        user = head(message, p.side_user_tokens)
        system = side_prefix(self.client.name, p.side_system_tokens)
        job = self.job([{"role": "system", "content": system.text}, {"role": "user", "content": user.text}],
                       system.ids + user.ids, p.side_output_tokens)
        return self.emit("side", ("side", self.client.name), job)

    def call(self, threads: Sequence[_Thread], kinds: Sequence[str], extra: Sequence[Job] = ()) -> Calls:
        """One call of each thread, sent together (with ``extra``); a thread at its compaction
        threshold first sends its summarisation call. Returns the calls' outcomes."""
        compacting = [t for t in threads if t.needs_compaction()]
        if compacting:
            jobs = []
            for thread in compacting:
                thread.flush_for_compaction(segment(self.text, self.p.compact_prompt_tokens))
                # from the text's RNG: when compactions fall depends on the answers' lengths,
                # and the structure's draws must not
                out = self.text.randint(*self.p.summary_tokens)
                job = self.job(list(thread.messages), thread.ids, out, thread.size)
                jobs.append(self.emit("compact", thread, job))
            results = yield Send(jobs)
            for thread, outcome in zip(compacting, results or [], strict=True):
                thread.compacted(self.answer(outcome))
        jobs = []
        for thread, kind in zip(threads, kinds, strict=True):
            thread.flush()
            job = self.job(list(thread.messages), thread.ids, self.output_len(), thread.size)
            jobs.append(self.emit(kind, thread, job))
        results = (yield Send([*jobs, *extra])) or []
        for thread, outcome in zip(threads, results, strict=False):
            thread.add("assistant", self.answer(outcome))
        return results[:len(threads)]

    def subagents(self) -> Generator[Send | Think, list[Outcome] | None, Seg]:
        """A group of sub-agents in lockstep rounds; returns their final answers (the parent's
        tool result)."""
        p, rng = self.p, self.rng
        prefix = client_prefix(self.client.name, self.client.prefix_tokens)
        self.note("group")
        group = []
        for _ in range(rng.randint(*p.subagent_group)):
            thread = _Thread(prefix, EMPTY, self.client, self.materialize)
            thread.add("user", segment(self.text, p.subagent_task.draw_int(rng)), typed=True)
            group.append(_SubAgent(thread, p.subagent_calls.draw_int(rng)))
        while active := [s for s in group if s.calls_left > 0]:
            threads = [s.thread for s in active]
            yield from self.call(threads, ["sub"] * len(threads))
            gaps = []
            for sub in active:
                sub.calls_left -= 1
                if sub.calls_left > 0:
                    gaps.append(p.tool_gap_s.draw(rng))
                    sub.thread.add("user", segment(self.text, p.append.draw_int(rng)))
                else:  # its last answer goes to the parent, not into its own context
                    sub.answer = sub.thread.pending[-1][1] if sub.thread.pending else EMPTY
                    sub.thread.pending = []
            if gaps:
                yield Think(max(gaps))
        return join([s.answer for s in group])


@dataclass
class _SubAgent:
    thread: _Thread
    calls_left: int
    answer: Seg = EMPTY


# ======================================= the spec ===========================================


def make_agent(spec: str, seed: int = 0, max_tokens: int | None = None) -> Agent:
    """``agent`` (the field mix) or ``agent:OPTIONS``, comma-separated: a client name
    (``agent:claude-code``), ``human=F`` (scale the human gaps), ``side=0`` (no side calls),
    ``subagents=0`` (no sub-agent groups)."""
    _, _, rest = spec.partition(":")
    params, client = PARAMS, None
    names = [c.name for c in PARAMS.clients]
    for option in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = option.partition("=")
        try:
            if not sep and key in names:
                client = key
            elif key == "human" and sep:
                params = replace(params, human_scale=float(value))
                if params.human_scale < 0:
                    raise ValueError
            elif key in ("side", "subagents") and value in ("0", "1"):
                params = (replace(params, side_calls=value == "1") if key == "side"
                          else replace(params, subagent_prob=PARAMS.subagent_prob * (value == "1")))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"agent workload: bad option {option!r} in {spec!r}: a client "
                             f"({', '.join(names)}), human=SCALE, side=0|1 or subagents=0|1") from None
    return Agent(seed, max_tokens, params, client)


# ======================================== checks ============================================


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) if ordered else math.nan


@dataclass
class CallRecord:
    kind: str  # user, tool, compact, sub, side
    session: int
    input: int
    hit: int  # leading tokens equal to an earlier prompt's (no eviction)
    output: int


@dataclass
class AgentChecks:
    """What :func:`checks` measures on generated sessions (no server)."""

    sessions: int
    records: list[CallRecord] = field(repr=False)
    requests: list[int] = field(repr=False)  # per session
    calls_per_request: list[int] = field(repr=False)  # main calls (user + tool), per request
    compactions: list[int] = field(repr=False)  # per session
    groups: int = 0  # sub-agent groups

    def of(self, *kinds: str) -> list[CallRecord]:
        return [r for r in self.records if r.kind in kinds]

    @property
    def main(self) -> list[CallRecord]:
        return self.of("user", "tool")

    def median_input(self, *kinds: str) -> float:
        """Median prompt tokens of the calls of these kinds (default: the main agent's)."""
        chosen = self.of(*(kinds or ("user", "tool")))
        return float(statistics.median(r.input for r in chosen)) if chosen else 0.0

    def new_tokens(self, *kinds: str) -> list[int]:
        """Each call's prompt tokens past its hit (default: the main agent's calls)."""
        return [r.input - r.hit for r in self.of(*(kinds or ("user", "tool")))]

    def hit_rate(self, *kinds: str) -> float:
        """Token-weighted hit rate of the calls of these kinds (default: every call)."""
        chosen = self.of(*kinds) if kinds else self.records
        total = sum(r.input for r in chosen)
        return sum(r.hit for r in chosen) / total if total else 0.0

    @property
    def compacted_share(self) -> float:
        return sum(1 for c in self.compactions if c) / max(1, len(self.compactions))

    @property
    def compactions_per_compacted(self) -> float:
        compacted = [c for c in self.compactions if c]
        return statistics.fmean(compacted) if compacted else 0.0

    @property
    def group_rate(self) -> float:
        """Sub-agent groups per main call."""
        return self.groups / max(1, len(self.main))

    @property
    def sub_share(self) -> float:
        """Sub-agent calls among the main and sub-agent calls (requests, in CC weka's terms)."""
        subs = len(self.of("sub"))
        return subs / max(1, subs + len(self.main))

    def rows(self) -> list[tuple[str, str, str]]:
        """(figure, this workload's, the field data's)."""
        main, new, q = self.main, self.new_tokens(), _quantile
        outputs = [r.output for r in main]
        per_request, requests = self.calls_per_request, self.requests
        if not main:
            return []
        return [
            ("sessions / model calls (every kind)", f"{self.sessions:,} / {len(self.records):,}",
             "4,265 / 357,161 (TraceLab)"),
            ("input tokens per main call: p50 / p90",
             f"{self.median_input():,.0f} / {q([r.input for r in main], 0.9):,.0f}",
             "126k Claude, 116k Codex (cached prefix) / >256k, 128-256k"),
            ("input tokens of a user request's first call: p50", f"{self.median_input('user'):,.0f}", "-"),
            ("input tokens per call, every kind: p50", f"{self.median_input(*KINDS):,.0f}", "-"),
            ("new tokens per main call: p50 / mean",
             f"{statistics.median(new):,.0f} / {statistics.fmean(new):,.0f}",
             "857 Claude, 886 Codex / context growth +1.7-1.8k per call"),
            ("prefix-hit rate, token-weighted, no eviction: every call / main / user-triggered",
             f"{self.hit_rate():.1%} / {self.hit_rate('user', 'tool'):.1%} / {self.hit_rate('user'):.1%}",
             "TraceLab 95.7 % with provider eviction, 98.6 % at a 1 h TTL; CC weka 96.8 %; "
             "Codex SWE-bench Pro 94.2 %"),
            ("output tokens per main call: p50 / mean",
             f"{statistics.median(outputs):,.0f} / {statistics.fmean(outputs):,.0f}",
             "252 Claude, 184 Codex / 523"),
            ("main calls per request: mean / p50 / p90",
             f"{statistics.fmean(per_request):.1f} / {q(per_request, 0.5):.0f} / {q(per_request, 0.9):.0f}",
             "8.8 / 2 / 21"),
            ("user requests per session: mean / p50 / p90 / p99",
             f"{statistics.fmean(requests):.1f} / {q(requests, 0.5):.0f} / {q(requests, 0.9):.0f} / "
             f"{q(requests, 0.99):.0f}", "9.2 / 1 / 18 / 137"),
            ("main calls per session: mean", f"{len(main) / max(1, self.sessions):.0f}", "~82"),
            ("sessions with a compaction / compactions per such session",
             f"{self.compacted_share:.1%} / {self.compactions_per_compacted:.1f}",
             "4.5 % Claude, 18.4 % Codex / 2.4 Claude, 4.2 Codex"),
            ("sub-agent groups per main call / sub-agent share of requests",
             f"{self.group_rate:.1%} / {self.sub_share:.0%}", "3 % / 43 % (Claude Code, CC weka 062126)"),
        ]

    def markdown(self) -> str:
        lines = ["| figure | agent workload | field data |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in self.rows()]
        return "\n".join(lines)


KINDS = ("user", "tool", "compact", "sub", "side")


class _Recorder:
    """Measures the calls of generated sessions as their scripts emit them.

    A call's hit: the leading tokens it shares with its conversation's previous prompt (the
    thread's account of what it reused) or with the client's fixed prefix once any call has
    sent it; a side call's, with the client's previous side call. ``exact``: compare the
    prompts' token ids instead (slower), and fail if the thread's account is ever more than a
    chance match short of them, or above them."""

    CHANCE = 4  # tokens: pseudo-words match by chance (1/512 each) where prompts diverge

    def __init__(self, params: AgentParams, exact: bool) -> None:
        self.exact = exact
        self.records: list[CallRecord] = []
        self.requests: list[int] = []
        self.per_request: list[int] = []
        self.compactions: list[int] = []
        self.groups = 0
        self.last: dict[object, tuple[int, ...]] = {}  # each thread's (side calls': the client's) last prompt
        self.sent: set[str] = set()  # clients whose fixed prefix some call has sent
        self.prefixes = {c.name: client_prefix(c.name, c.prefix_tokens).ids for c in params.clients}
        self.session, self.client = 0, ""

    def start(self, session: int, client: str) -> None:
        self.session, self.client = session, client
        self.requests.append(0)
        self.compactions.append(0)

    def end(self) -> None:
        for owner in [k for k in self.last if isinstance(k, _Thread)]:
            del self.last[owner]  # a session's conversations end with it

    def _hit(self, kind: str, owner: object, ids: tuple[int, ...]) -> int:
        previous = self.last.get(owner)
        self.last[owner] = ids
        if kind == "side" or self.exact:
            hit = 0 if previous is None else _lcp(ids, previous)
        else:
            assert isinstance(owner, _Thread)
            hit = owner.reused
        prefix = self.prefixes[self.client]
        if kind != "side":
            if self.client in self.sent:
                hit = max(hit, _lcp(ids, prefix) if self.exact else len(prefix))
            self.sent.add(self.client)
            if self.exact:
                assert isinstance(owner, _Thread)
                account = max(owner.reused, len(prefix) if hit >= len(prefix) else 0)
                if not account <= hit <= account + self.CHANCE:
                    raise AssertionError(f"session {self.session} {kind} call: {hit} tokens shared, "
                                         f"the thread accounts for {account}")
        return hit

    def __call__(self, kind: str, owner: object, job: Job | None) -> None:
        if job is None:
            self.groups += kind == "group"
            return
        ids = job.prompt_ids
        size = owner.size if isinstance(owner, _Thread) else len(ids)
        if self.exact and size != len(ids):
            raise AssertionError(f"session {self.session}: a prompt of {len(ids)} tokens counted as {size}")
        self.records.append(CallRecord(kind, self.session, size, self._hit(kind, owner, ids), job.max_tokens))
        if kind == "user":
            self.requests[-1] += 1
            self.per_request.append(1)
        elif kind == "tool":
            self.per_request[-1] += 1
        elif kind == "compact":
            self.compactions[-1] += 1


def run_script(script: Script) -> None:
    """Drive a script without a server: every call answered with its full length, no waits."""
    value: list[Outcome] | None = None
    while True:
        try:
            action = script.send(value)
        except StopIteration:
            return
        value = [Outcome(job.max_tokens) for job in action.jobs] if isinstance(action, Send) else None


def checks(seed: int = 0, sessions: int = 1000, client: str | None = None,
           params: AgentParams = PARAMS, exact: bool = False) -> AgentChecks:
    """Generate ``sessions`` sessions without running them (every call answered with its full
    length) and measure them. A call's hit is the longest prefix of its prompt equal to an
    earlier prompt's (a cache without eviction, token-exact): its own conversation's previous
    prompt, the client's fixed prefix once any call has sent it, or the client's previous side
    call; by construction no other earlier prompt shares more (``exact``: see _Recorder)."""
    agent = Agent(seed, None, params, client)
    recorder = _Recorder(params, exact)
    for index in range(sessions):
        recorder.start(index, agent.pick(agent.rng(index)).name)
        run_script(agent.session(index, recorder, materialize=exact))
        recorder.end()
    return AgentChecks(sessions, recorder.records, recorder.requests, recorder.per_request,
                       recorder.compactions, recorder.groups)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m gateway.bench.agent",
                                     description="The agent workload's figures against the field data's.")
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client", choices=[c.name for c in CLIENTS])
    args = parser.parse_args(argv)
    result = checks(args.seed, args.sessions, args.client)
    print(f"agent workload{':' + args.client if args.client else ''}, seed {args.seed}, "
          f"{args.sessions} sessions\n")
    print(result.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CLIENTS", "PARAMS", "Agent", "AgentChecks", "AgentParams", "Client", "LogNormal", "checks",
           "make_agent"]
