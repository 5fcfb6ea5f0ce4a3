"""Trace replay: the request logs users already have, as workloads with their arrival times.

One module of ~460 lines on purpose: the three formats are one contract (``Trace``: arrivals,
their times, the closed-loop view) read by one loader that tells them apart; split, each
format would be a module of ~100 lines importing the others' helpers.

Three formats (``load_trace``; the format is detected from the file when not given):

- **mooncake** (Mooncake's FAST'25 traces, JSON lines): ``{"timestamp": ms, "input_length": n,
  "output_length": m, "hash_ids": [...]}``. ``hash_ids`` name the prompt's blocks of 512 tokens
  (the last may be partial): equal ids are equal blocks, so two requests whose ids start alike
  share that prefix. Each record is one request at ``(timestamp - first) / 1000 * time_scale /
  rate_scale`` seconds (SGLang's replay: timestamps in ms, sorted, relative to the first, times
  ``--mooncake-slowdown-factor``: sglang 0.5.23 wheel: sglang/benchmark/datasets/mooncake.py:63-71;
  ``time_scale`` is that factor, ``rate_scale`` divides it: 2 = twice the trace's rate).
  The prompt is token ids (``/v1/completions``, ``prompt`` a list of ids), exactly
  ``input_length`` of them: block ``h`` is 512 ids made from ``h`` alone (its first four are
  ``h``'s digits in base 512, so distinct ids give distinct blocks; the rest drawn from an RNG
  seeded by ``h``), truncated to ``input_length``; ids past the last block (a trace whose
  ``input_length`` exceeds 512 per id) are drawn for that request alone. Token ids, not text,
  so the length is exact on any server, whatever its tokenizer (SGLang and vLLM take a list of
  ids as the prompt; the simulator counts one id as one token). The output is exactly
  ``output_length``: ``max_tokens`` with ``ignore_eos``, temperature 0, as SGLang's bench sends
  (serving.py:311-317). SGLang's own Mooncake replay differs: its prompt is ``f"{hash_id}"`` and
  128 words "hi" per block (mooncake.py:82-88), so neither the input length nor the 512-token
  blocks are the trace's, and it replays the timestamps only with ``--backend sglang``
  (serving.py:1554-1566), else it falls back to ``--request-rate``.
- **agentic** (SGLang's agentic-trace JSON, e.g. OpenHands / SWE-smith):
  ``{"conversations": [[{"messages": [...], "prompt_tokens": n}, ...], ...]}``, each turn's
  ``messages`` only the new non-assistant messages (agentic_trace.py:19-42). Each conversation
  is a session replayed round by round as SGLang does (serving.py:1334-1378): the round's
  messages join the history (role and content only, serving.py:1316-1331), the whole history
  is sent to ``/v1/chat/completions``, and the next round waits for the answer, whose text
  joins the history as the assistant's message. Turns without messages are skipped
  (agentic_trace.py:85). Output per round: 220 tokens (SGLang's default,
  agentic_trace.py:12-14, 78), with ``ignore_eos``. The format has no times: conversations
  arrive at a session rate, or all at once (SGLang's default ``--request-rate inf``). A turn may
  carry ``"delay_s"`` (this project's extension, not in SGLang's format): seconds between the
  previous answer and this round.
- **recorded** (the project's recorded-requests file, what ``--workload file:PATH`` reads): one
  ``{"path": ..., "body": {...}, "headers": {...}}`` per line, replayed as recorded; an optional
  ``"timestamp"`` (seconds from the recording's start) on every line gives the arrival times
  (scaled like Mooncake's), else a request rate does.

Closed loop (``closed_loop``, what ``mtp-gateway calibrate --trace`` sweeps): C clients each
take the trace's next request (or session) when the last is answered; the arrival times are
not used, and past the end the trace starts again from its first request.

The virtual simulator's token view (``Job.prompt_ids``): Mooncake's ids themselves; for chat,
the simulator's own tokens (its chat template's words, ``gateway.sim.text``), so a virtual
replay and one against the simulator over HTTP count the same prompt lengths.
"""

from __future__ import annotations

import functools
import json
import math
import random
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gateway.bench.arrivals import Unit
from gateway.bench.workloads import (
    WORD_ID_BASE,
    Job,
    Outcome,
    RecordedFile,
    Script,
    Send,
    Think,
    Workload,
    make_workload,
    words,
)

Format = Literal["mooncake", "agentic", "recorded"]
FORMATS: tuple[Format, ...] = ("mooncake", "agentic", "recorded")
MOONCAKE_BLOCK_TOKENS = 512  # Mooncake's FAST'25 traces hash prompts in blocks of 512 tokens
AGENTIC_OUTPUT_LEN = 220  # sglang 0.5.23 wheel: sglang/benchmark/datasets/agentic_trace.py:14
_ID_DIGITS = 4  # a block's first ids: its hash id in base 512 (ids < 512**4 are distinct)
_VOCAB = 512


class Trace(Workload):
    """A trace as a workload: script ``i`` is the trace's ``i``-th arrival (a request, or a
    session), and ``times`` their arrival times when the trace has them. Scripts past the end
    wrap around (a closed-loop calibration may ask for more)."""

    format: Format
    unit: Unit = "request"
    times: tuple[float, ...] | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def requests(self) -> int:
        """How many requests one pass over the trace sends."""
        return len(self)

    def closed_loop(self) -> Workload:
        """The trace as a closed loop runs it (see :func:`closed_loop`): itself, unless its
        arrivals are not its sessions (recorded: a line is an arrival, an x-session-id a
        session)."""
        return self


# --- Mooncake -------------------------------------------------------------------------------

@dataclass(frozen=True)
class MooncakeRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@functools.lru_cache(maxsize=65536)
def block_ids(hash_id: int) -> tuple[int, ...]:
    """The 512 token ids of block ``hash_id``: its base-512 digits, then ids drawn from an RNG
    seeded by it. A function of the id alone: equal ids, equal blocks; distinct, distinct."""
    if not 0 <= hash_id < _VOCAB**_ID_DIGITS:
        raise ValueError(f"hash id {hash_id} out of range [0, {_VOCAB**_ID_DIGITS})")
    digits = [(hash_id // _VOCAB**k) % _VOCAB for k in reversed(range(_ID_DIGITS))]
    rng = random.Random(f"mooncake-block:{hash_id}")
    rest = [rng.randrange(_VOCAB) for _ in range(MOONCAKE_BLOCK_TOKENS - _ID_DIGITS)]
    return tuple(WORD_ID_BASE + d for d in digits + rest)


def mooncake_prompt(record: MooncakeRecord, index: int) -> tuple[int, ...]:
    """Exactly ``input_length`` token ids: the blocks of its hash ids, then (past them) ids of
    this request alone."""
    ids: list[int] = []
    for hash_id in record.hash_ids:
        if len(ids) >= record.input_length:
            break
        ids.extend(block_ids(hash_id))
    missing = record.input_length - len(ids)
    if missing > 0:
        rng = random.Random(f"mooncake-tail:{index}")
        ids.extend(WORD_ID_BASE + rng.randrange(_VOCAB) for _ in range(missing))
    return tuple(ids[:record.input_length])


def parse_mooncake(path: Path) -> list[MooncakeRecord]:
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            record = MooncakeRecord(float(raw["timestamp"]), int(raw["input_length"]),
                                    int(raw["output_length"]),
                                    tuple(int(h) for h in raw.get("hash_ids") or ()))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: expected a Mooncake record "
                             '{"timestamp": ms, "input_length": n, "output_length": m, '
                             f'"hash_ids": [...]}} ({exc})') from exc
        if record.input_length < 1 or record.output_length < 1 or not math.isfinite(record.timestamp_ms):
            raise ValueError(f"{path}:{lineno}: input_length and output_length must be >= 1 and "
                             "the timestamp finite")
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def scaled_times(stamps: Sequence[float], time_scale: float = 1.0, rate_scale: float = 1.0,
                 per_second: float = 1.0) -> tuple[float, ...]:
    """Seconds from the first stamp (stamps in order, ``per_second`` of them a second), times
    ``time_scale / rate_scale``."""
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"the time scale must be a finite number > 0, got {time_scale}")
    if not (rate_scale > 0 and math.isfinite(rate_scale)):
        raise ValueError(f"the rate scale must be a finite number > 0, got {rate_scale}")
    first = stamps[0] if stamps else 0.0
    return tuple((t - first) / per_second * time_scale / rate_scale for t in stamps)


class MooncakeTrace(Trace):
    name = "mooncake"
    format: Format = "mooncake"

    def __init__(self, path: str | Path, *, time_scale: float = 1.0, rate_scale: float = 1.0,
                 seed: int = 0, max_tokens: int | None = None) -> None:
        super().__init__(seed, max_tokens)
        self.path = Path(path)
        # sorted by timestamp, as SGLang replays (mooncake.py:63); a stable sort keeps ties in order
        self.records = sorted(parse_mooncake(self.path), key=lambda r: r.timestamp_ms)
        self.times = scaled_times([r.timestamp_ms for r in self.records], time_scale, rate_scale, 1000.0)

    def __len__(self) -> int:
        return len(self.records)

    def job(self, index: int) -> Job:
        record = self.records[index % len(self.records)]
        ids = mooncake_prompt(record, index % len(self.records))
        out = self.cap(record.output_length)
        body = {"prompt": list(ids), "max_tokens": out, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        return Job("/v1/completions", body, {}, ids, out, greedy=True)

    def script(self, index: int) -> Script:
        yield Send([self.job(index)])


# --- SGLang's agentic trace ------------------------------------------------------------------

# The simulator's chat template (gateway.sim.text.chat_prompt_text), word by word.
_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"


def _chat_id(word: str) -> int:
    return WORD_ID_BASE + zlib.crc32(word.encode())


def message_ids(role: str, content: str) -> tuple[int, ...]:
    """One message's tokens as the simulator's template renders it: ``<|im_start|>ROLE words
    ...<|im_end|>``, one token per whitespace-separated word."""
    return tuple(map(_chat_id, f"{_IM_START}{role} {content}{_IM_END}".split()))


GENERATION_PROMPT = (_chat_id(f"{_IM_START}assistant"),)  # the template's last line


@dataclass(frozen=True)
class AgenticTurn:
    messages: tuple[Mapping[str, str], ...]
    delay_s: float = 0.0


def _content(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):  # typed parts: their text
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in value)
    return str(value)


def _round_messages(turn: Any) -> tuple[Mapping[str, str], ...] | None:
    """A round's messages as SGLang normalises them (serving.py:1316-1331): a string is one
    user message; a list keeps each message's role and content."""
    if isinstance(turn, str):
        return ({"role": "user", "content": turn},)
    if isinstance(turn, list) and turn and all(isinstance(m, dict) and "role" in m and "content" in m
                                               for m in turn):
        return tuple({"role": str(m["role"]), "content": _content(m["content"])} for m in turn)
    return None


def parse_agentic(path: Path, data: Any | None = None) -> list[list[AgenticTurn]]:
    if data is None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from exc
    conversations = data.get("conversations") if isinstance(data, dict) else None
    if not conversations or not isinstance(conversations, list):
        raise ValueError(f"{path}: no 'conversations' (SGLang's agentic-trace format)")
    parsed = []
    for n, conversation in enumerate(conversations):
        turns = []
        for k, turn in enumerate(conversation if isinstance(conversation, list) else []):
            if not isinstance(turn, dict) or not turn.get("messages"):
                continue  # agentic_trace.py:85 skips turns without messages
            messages = _round_messages(turn["messages"])
            delay = turn.get("delay_s", 0.0)
            if messages is None or not isinstance(delay, int | float) or not 0 <= delay < math.inf:
                raise ValueError(f"{path}: conversation {n}, turn {k}: expected messages "
                                 "(a string, or a list of {role, content}) and a delay_s >= 0")
            turns.append(AgenticTurn(messages, float(delay)))
        if turns:
            parsed.append(turns)
    if not parsed:
        raise ValueError(f"{path}: no usable conversations")
    return parsed


class AgenticTrace(Trace):
    name = "agentic-trace"
    format: Format = "agentic"
    unit: Unit = "session"

    def __init__(self, path: str | Path, *, seed: int = 0, max_tokens: int | None = None,
                 output_len: int = AGENTIC_OUTPUT_LEN, data: Any | None = None) -> None:
        super().__init__(seed, max_tokens)
        self.path = Path(path)
        self.conversations = parse_agentic(self.path, data)
        self.output_len = self.cap(output_len)

    def __len__(self) -> int:
        return len(self.conversations)

    @property
    def requests(self) -> int:
        return sum(map(len, self.conversations))

    def script(self, index: int) -> Script:
        n = index % len(self.conversations)
        session = f"trace-{self.seed}-{index}"
        headers = {"x-session-id": session}
        history: list[dict[str, str]] = []
        ids: tuple[int, ...] = ()
        rng = self.rng(index)
        for k, turn in enumerate(self.conversations[n]):
            if turn.delay_s > 0 and k > 0:
                yield Think(turn.delay_s)
            for message in turn.messages:
                history.append(dict(message))
                ids += message_ids(message["role"], message["content"])
            body = {"messages": list(history), "max_tokens": self.output_len, "ignore_eos": True,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            job = Job("/v1/chat/completions", body, dict(headers), ids + GENERATION_PROMPT,
                      self.output_len, greedy=True, session=session)
            results = yield Send([job])
            outcome = (results or [Outcome(0)])[0]
            # the server's reply joins the history (serving.py:1374-1376); in virtual time,
            # pseudo-words of the length it had
            reply = outcome.text if outcome.text else words(rng, max(outcome.tokens, 1))[0]
            history.append({"role": "assistant", "content": reply})
            ids += message_ids("assistant", reply)


# --- the project's recorded requests ---------------------------------------------------------

class RecordedTrace(Trace):
    name = "recorded"
    format: Format = "recorded"

    def __init__(self, path: str | Path, *, time_scale: float = 1.0, rate_scale: float = 1.0,
                 seed: int = 0, max_tokens: int | None = None) -> None:
        super().__init__(seed, max_tokens)
        self.path = Path(path)
        self.jobs = RecordedFile(self.path, seed, max_tokens).jobs
        stamps: list[float | None] = []
        for lineno, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                value = json.loads(line).get("timestamp")
                if value is not None and not (isinstance(value, int | float) and math.isfinite(value)):
                    raise ValueError(f"{self.path}:{lineno}: timestamp must be a number of seconds")
                stamps.append(None if value is None else float(value))
        timed = [s for s in stamps if s is not None]
        if timed and len(timed) != len(stamps):
            raise ValueError(f"{self.path}: a timestamp on some lines only (every line, or none)")
        if timed:
            order = sorted(range(len(timed)), key=timed.__getitem__)
            self.jobs = [self.jobs[i] for i in order]
            self.times = scaled_times([timed[i] for i in order], time_scale, rate_scale)

    def __len__(self) -> int:
        return len(self.jobs)

    def script(self, index: int) -> Script:
        yield Send([self.jobs[index % len(self.jobs)]])

    def closed_loop(self) -> Workload:
        return RecordedSessions(self)


class RecordedSessions(Workload):
    """A recorded trace's requests grouped by their ``x-session-id``: script ``i`` is the
    ``i``-th session (by its first request) sending its requests one after another, each when
    the one before is answered; a request without a session is a session of its own."""

    name = "recorded-sessions"

    def __init__(self, trace: RecordedTrace) -> None:
        super().__init__(trace.seed, trace.max_tokens)
        by_session: dict[str, list[Job]] = {}
        self.sessions: list[list[Job]] = []
        for job in trace.jobs:
            if job.session is None:
                self.sessions.append([job])
            elif job.session in by_session:
                by_session[job.session].append(job)
            else:
                self.sessions.append(by_session.setdefault(job.session, [job]))

    def script(self, index: int) -> Script:
        for job in self.sessions[index % len(self.sessions)]:
            yield Send([job])


# --- loading -----------------------------------------------------------------------------------

def detect_format(path: Path) -> tuple[Format, Any | None]:
    """The format from the content: a JSON document with ``conversations`` (agentic), or JSON
    lines with ``hash_ids``/``input_length`` (mooncake) or ``path`` and ``body`` (recorded).
    Returns the parsed document too when the whole file was read."""
    text = path.read_text(encoding="utf-8")
    first = next((line for line in text.splitlines() if line.strip()), "")
    try:
        head = json.loads(first)
    except ValueError:
        head = None
    if not isinstance(head, dict):
        try:
            head = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path}: neither JSON lines nor a JSON document ({exc})") from exc
        if isinstance(head, dict) and "conversations" in head:
            return "agentic", head
        raise ValueError(f"{path}: unknown trace format; give --trace-format")
    if "conversations" in head:
        return "agentic", head
    if "hash_ids" in head or "input_length" in head:
        return "mooncake", None
    if "path" in head and "body" in head:
        return "recorded", None
    raise ValueError(f"{path}: unknown trace format (first record's keys: {', '.join(head)}); "
                     "give --trace-format")


def load_trace(path: str | Path, fmt: Format | None = None, *, time_scale: float = 1.0,
               rate_scale: float = 1.0, seed: int = 0, max_tokens: int | None = None) -> Trace:
    path = Path(path)
    data = None
    if fmt is None:
        fmt, data = detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "mooncake":
        return MooncakeTrace(path, time_scale=time_scale, rate_scale=rate_scale, seed=seed,
                             max_tokens=max_tokens)
    if fmt == "recorded":
        return RecordedTrace(path, time_scale=time_scale, rate_scale=rate_scale, seed=seed,
                             max_tokens=max_tokens)
    if time_scale != 1.0 or rate_scale != 1.0:
        raise ValueError("an agentic trace has no timestamps to scale: give --session-rate instead")
    return AgenticTrace(path, seed=seed, max_tokens=max_tokens, data=data)


# --- a workload or a trace, closed-loop ----------------------------------------------------------

def workload_or_trace(workload: str | None, trace: str | None, trace_format: Format | None = None, *,
                      seed: int = 0, max_tokens: int | None = None, time_scale: float = 1.0,
                      rate_scale: float = 1.0) -> tuple[Workload, str]:
    """``--workload SPEC`` or ``--trace PATH`` (``bench``'s and ``calibrate``'s): the workload
    (a :class:`Trace` for a trace) and its name for the report."""
    if trace:
        if workload is not None:
            raise ValueError("--trace replaces --workload: give one of them")
        loaded = load_trace(trace, trace_format, time_scale=time_scale, rate_scale=rate_scale,
                            seed=seed, max_tokens=max_tokens)
        return loaded, f"{loaded.format} trace {Path(trace).name}"
    if trace_format:
        raise ValueError("--trace-format needs --trace")
    spec = workload or "seed"
    return make_workload(spec, seed, max_tokens), f"{spec} workload"


def closed_loop(workload: Workload) -> Workload:
    """What a closed loop of C clients runs of ``workload``: each client the next script, back
    to back. A trace's arrival times are left out: its requests go in the trace's order with
    their own lengths and prompts (so its shared prefixes are shared), a session's (an agentic
    conversation's, a recorded ``x-session-id``'s) one after another on one client, and past
    the trace's end they start again from its first. Any other workload runs as it is. What
    ``mtp-gateway calibrate`` sweeps, and what a ``pair-turns`` target's crossover is
    calibrated on in an open-loop replay."""
    return workload.closed_loop() if isinstance(workload, Trace) else workload
