"""Workloads: what the clients of one concurrency level send.

A workload hands out *scripts*, one per client session. A script is a generator that yields
``Send([jobs])`` (sent in parallel; the script resumes with their outcomes once all are done)
or ``Think(seconds)``; a plain request workload is a script of one ``Send``. The HTTP driver
and the virtual-time driver run the same scripts, so both measure the same traffic.

Every script is built from its own RNG seeded by (workload seed, name, script index), so the
n-th script of a level is the same whichever target runs it.

- ``seed``: the seed's benchmark: ``/v1/completions``, prompt = 1000 copies of token id 23066,
  1000 output tokens, ``ignore_eos``, temperature 0 (a flattering case for MTP: every draft of a
  repeated token is accepted).
- ``chat``: ``/v1/chat/completions``, a shared 200-token system prompt, user prompts of
  50..6000 tokens (log-normal, median ~600) and outputs of 32..1500 (median ~300),
  temperature 0.7.
- ``agent``: coding-agent sessions shaped by measured field data (client prefixes, 100k-token
  contexts, tool and human gaps, compaction, sub-agents, side calls): gateway/bench/agent.py,
  docs/workloads.md. ``agent:CLIENT[,human=SCALE]`` for one client or compressed human gaps.
- ``agentic``: the project's invented agent sessions, kept to compare with earlier results (the
  README's and lab/results' figures were measured on it), not as a model of real agents (their
  contexts are ~10-30x larger and their bursts rarer: see ``agent``). Sent with an
  ``x-session-id`` header: a shared 3000-token system prompt, a per-session context of
  1000..6000 tokens, 4..8 turns; each turn appends the user message and the previous answer to
  the context (so the prompt grows and its prefix is cached where the last turn ran), a think
  time (tool execution, exponential, mean 2 s) between turns, and in a quarter of the turns a
  burst of 2..4 parallel sub-requests (sub-agents) whose answers join the context.
- ``file:PATH.jsonl``: recorded requests, one JSON object per line:
  ``{"path": "/v1/chat/completions", "body": {...}, "headers": {...}}`` (headers optional).

Output lengths are enforced with ``ignore_eos`` (SGLang and vLLM honour it), so a level's work
is the same on every target. Text is made of pseudo-words; ``prompt_ids`` is the token view the
virtual simulator uses (one id per word).
"""

from __future__ import annotations

import functools
import json
import math
import random
import zlib
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SEED_TOKEN_ID = 23066
SEED_PROMPT_LEN = 1000
SEED_OUTPUT_LEN = 1000
WORD_ID_BASE = 1000


@dataclass(frozen=True)
class Job:
    """One HTTP request and its virtual-time equivalent."""

    path: str
    body: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    prompt_ids: tuple[int, ...] = ()
    max_tokens: int = 256
    greedy: bool = False
    session: str | None = None


@dataclass(frozen=True)
class Send:
    jobs: list[Job]


@dataclass(frozen=True)
class Think:
    seconds: float


@dataclass(frozen=True)
class Outcome:
    tokens: int
    text: str = ""
    error: str | None = None


Script = Generator[Send | Think, list[Outcome] | None, None]

# --- pseudo-text ---------------------------------------------------------------------------

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "po", "si", "de", "gu", "fa", "zo", "ve", "bi",
              "xu", "ja"]
VOCAB = [a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in ("", "n", "r")][:512]
_VOCAB_INDEX = range(len(VOCAB))
_WORD_IDS = tuple(WORD_ID_BASE + i for i in _VOCAB_INDEX)


def words(rng: random.Random, n: int) -> tuple[str, tuple[int, ...]]:
    """``n`` pseudo-words: their text and their token ids (one id per word)."""
    picks = rng.choices(_VOCAB_INDEX, k=n)
    # map over the bound lookups: a virtual chat sweep makes millions of words.
    return " ".join(map(VOCAB.__getitem__, picks)), tuple(map(_WORD_IDS.__getitem__, picks))


def _lognormal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _stream_body(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


class Workload:
    name = "base"

    def __init__(self, seed: int = 0, max_tokens: int | None = None) -> None:
        self.seed = seed
        self.max_tokens = max_tokens  # caps every request's output (quick runs)

    def rng(self, index: int) -> random.Random:
        return random.Random(f"{self.seed}:{self.name}:{index}")

    def cap(self, n: int) -> int:
        return n if self.max_tokens is None else max(1, min(n, self.max_tokens))

    def script(self, index: int) -> Script:
        raise NotImplementedError


class Seed(Workload):
    name = "seed"

    def __init__(self, seed: int = 0, max_tokens: int | None = None,
                 prompt_len: int = SEED_PROMPT_LEN, output_len: int = SEED_OUTPUT_LEN) -> None:
        super().__init__(seed, max_tokens)
        self.prompt = (SEED_TOKEN_ID,) * prompt_len
        self.output_len = output_len

    def script(self, index: int) -> Script:
        out = self.cap(self.output_len)
        body = _stream_body({"prompt": list(self.prompt), "max_tokens": out, "ignore_eos": True,
                             "temperature": 0})
        yield Send([Job("/v1/completions", body, {}, self.prompt, out, greedy=True)])


class Chat(Workload):
    name = "chat"
    SYSTEM_TOKENS = 200

    def __init__(self, seed: int = 0, max_tokens: int | None = None) -> None:
        super().__init__(seed, max_tokens)
        self.system_text, self.system_ids = words(random.Random(f"{seed}:chat:system"),
                                                  self.SYSTEM_TOKENS)

    def script(self, index: int) -> Script:
        out_len, text, ids = _chat_request(self.seed, self.name, index)
        out = self.cap(out_len)
        body = _stream_body({
            "messages": [{"role": "system", "content": self.system_text},
                         {"role": "user", "content": text}],
            "max_tokens": out, "temperature": 0.7, "ignore_eos": True,
        })
        yield Send([Job("/v1/chat/completions", body, {}, self.system_ids + ids, out)])


@functools.lru_cache(maxsize=4096)
def _chat_request(seed: int, name: str, index: int) -> tuple[int, str, tuple[int, ...]]:
    """The index-th chat request (uncapped output length, user text, its ids), a pure function
    of its RNG's seed: cached, since every level and target of a sweep replays scripts 0, 1, ...
    and drawing the words was a quarter of a virtual chat sweep's time. 4096 entries: a C=128
    steady level of 150 s starts ~1,000 scripts; ~10 KB each."""
    rng = random.Random(f"{seed}:{name}:{index}")
    prompt_len = _lognormal_int(rng, 600, 0.9, 50, 6000)
    out = _lognormal_int(rng, 300, 0.7, 32, 1500)
    text, ids = words(rng, prompt_len)
    return out, text, ids


class Agentic(Workload):
    """The project's invented agent sessions (see the module docstring): kept for comparison
    with the results measured on it; the ``agent`` workload is the one shaped by field data."""

    name = "agentic"
    SYSTEM_TOKENS = 3000
    TURNS = (4, 8)
    CONTEXT_TOKENS = (1000, 6000)
    THINK_MEAN_S = 2.0
    BURST_PROB = 0.25
    BURST_SIZE = (2, 4)

    def __init__(self, seed: int = 0, max_tokens: int | None = None,
                 think_scale: float = 1.0) -> None:
        super().__init__(seed, max_tokens)
        self.think_scale = think_scale
        self.system_text, self.system_ids = words(random.Random(f"{seed}:agentic:system"),
                                                  self.SYSTEM_TOKENS)

    def script(self, index: int) -> Script:
        rng = self.rng(index)
        session = f"bench-{self.seed}-{index}"
        headers = {"x-session-id": session}
        ctx_text, ctx_ids = words(rng, rng.randint(*self.CONTEXT_TOKENS))
        messages: list[dict[str, str]] = [
            {"role": "system", "content": self.system_text + "\n" + ctx_text}]
        ids = self.system_ids + ctx_ids
        turns = rng.randint(*self.TURNS)
        for turn in range(turns):
            user_text, user_ids = words(rng, _lognormal_int(rng, 120, 0.8, 20, 1500))
            messages.append({"role": "user", "content": user_text})
            ids += user_ids
            if turn > 0 and rng.random() < self.BURST_PROB:
                subs = []
                for _ in range(rng.randint(*self.BURST_SIZE)):
                    task_text, task_ids = words(rng, rng.randint(30, 200))
                    subs.append(self._job(messages + [{"role": "user", "content": task_text}],
                                          ids + task_ids,
                                          self.cap(_lognormal_int(rng, 250, 0.6, 32, 1200)),
                                          headers, session))
                results = yield Send(subs)
                for result in results or []:
                    text, result_ids = self._answer(rng, result)
                    messages.append({"role": "user", "content": "sub-agent result: " + text})
                    ids += result_ids
            job = self._job(list(messages), ids, self.cap(_lognormal_int(rng, 250, 0.7, 32, 1500)),
                            headers, session)
            results = yield Send([job])
            text, answer_ids = self._answer(rng, (results or [Outcome(0)])[0])
            messages.append({"role": "assistant", "content": text})
            ids += answer_ids
            if turn < turns - 1:
                think = min(10.0, max(0.2, rng.expovariate(1.0 / self.THINK_MEAN_S)))
                yield Think(think * self.think_scale)

    @staticmethod
    def _job(messages: list[dict[str, str]], ids: tuple[int, ...], out: int,
             headers: Mapping[str, str], session: str) -> Job:
        body = _stream_body({"messages": messages, "max_tokens": out, "temperature": 0.7,
                             "ignore_eos": True})
        return Job("/v1/chat/completions", body, dict(headers), ids, out, session=session)

    @staticmethod
    def _answer(rng: random.Random, outcome: Outcome) -> tuple[str, tuple[int, ...]]:
        """The answer as the next turn's context; text from the server, ids synthesised."""
        text, ids = words(rng, max(outcome.tokens, 1))
        return (outcome.text or text), ids


class RecordedFile(Workload):
    name = "file"

    def __init__(self, path: str | Path, seed: int = 0, max_tokens: int | None = None) -> None:
        super().__init__(seed, max_tokens)
        self.path = Path(path)
        self.jobs = [self._parse(n, line) for n, line in
                     enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
        if not self.jobs:
            raise ValueError(f"{self.path}: no requests")

    def _parse(self, lineno: int, line: str) -> Job:
        try:
            raw = json.loads(line)
            path, body = raw["path"], dict(raw["body"])
            headers = {str(k): str(v) for k, v in (raw.get("headers") or {}).items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.path}:{lineno}: expected "
                             f'{{"path": ..., "body": {{...}}, "headers": {{...}}?}} ({exc})') from exc
        out = int(body.get("max_completion_tokens") or body.get("max_tokens") or 256)
        out = self.cap(out)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = out
        else:
            body["max_tokens"] = out
        text = json.dumps(body.get("messages") or body.get("prompt") or "")
        prompt_ids = tuple(WORD_ID_BASE + zlib.crc32(w.encode()) % 100_000 for w in text.split()) or (0,)
        session = next((v for k, v in headers.items() if k.lower() == "x-session-id"), None)
        return Job(path, _stream_body(body), headers, prompt_ids, out,
                   greedy=body.get("temperature") == 0, session=session)

    def script(self, index: int) -> Script:
        yield Send([self.jobs[index % len(self.jobs)]])


WORKLOADS = ("seed", "chat", "agentic", "agent")


def make_workload(spec: str, seed: int = 0, max_tokens: int | None = None) -> Workload:
    if spec.startswith("file:"):
        return RecordedFile(spec[5:], seed, max_tokens)
    if spec == "agent" or spec.startswith("agent:"):
        from gateway.bench.agent import make_agent  # it builds on this module

        return make_agent(spec, seed, max_tokens)
    classes: dict[str, type[Workload]] = {"seed": Seed, "chat": Chat, "agentic": Agentic}
    if spec not in classes:
        raise ValueError(f"unknown workload {spec!r}: one of {', '.join(WORKLOADS)}, agent:OPTIONS "
                         "or file:PATH.jsonl")
    return classes[spec](seed, max_tokens)
