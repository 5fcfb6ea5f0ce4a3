"""Trace replay (gateway/bench/traces.py) in virtual time and over HTTP.

What the simulator itself recorded (``VirtualSim(log_requests=True)``: every submitted request's
time, prompt length, the tokens its prefix cache gave it, what it generated) is checked against
the trace: exact input and output lengths, the prefix sharing implied by equal hash ids, and the
arrival times (the trace's timestamps, scaled). One test replays over HTTP against the simulated
pair (and the gateway in front of it) and checks the lengths the servers' usage reports.
"""

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from gateway.bench.arrivals import OpenLoop
from gateway.bench.loadgen import Target, run_http_open
from gateway.bench.targets import build_targets, run_open
from gateway.bench.traces import (
    GENERATION_PROMPT,
    MOONCAKE_BLOCK_TOKENS,
    AgenticTrace,
    MooncakeTrace,
    RecordedTrace,
    block_ids,
    closed_loop,
    detect_format,
    load_trace,
    message_ids,
)
from gateway.bench.workloads import Job, Outcome, Script, Send, Workload, make_workload
from gateway.cli import main
from gateway.config import load_settings
from gateway.sim.engine import CACHE_BLOCK_TOKENS
from gateway.sim.server import SimOptions, start_sim_pair
from gateway.sim.text import chat_prompt_text
from tests.conftest import live_gateway

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"
MOONCAKE = DATA / "mooncake_sample.jsonl"
AGENTIC = DATA / "agentic_sample.json"
RECORDED = DATA / "recorded_sample.jsonl"
ROUTING = load_settings(None).routing


def _raw_mooncake() -> list[dict]:
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["timestamp"])  # stable: ties keep the file's order


def _shared_prefix(a: dict, b: dict) -> int:
    """Tokens two Mooncake records share by their hash ids alone: equal leading ids are equal
    512-token blocks; a block partial in either (its prompt ends inside it) shares what both
    have of it, and ends the shared prefix."""
    shared = 0
    for k, (x, y) in enumerate(zip(a["hash_ids"], b["hash_ids"], strict=False)):
        if x != y:
            break
        in_a = min(MOONCAKE_BLOCK_TOKENS, a["input_length"] - k * MOONCAKE_BLOCK_TOKENS)
        in_b = min(MOONCAKE_BLOCK_TOKENS, b["input_length"] - k * MOONCAKE_BLOCK_TOKENS)
        shared += min(in_a, in_b)
        if min(in_a, in_b) < MOONCAKE_BLOCK_TOKENS:
            break
    return shared


def _single(name: str = "single-plain"):
    return build_targets([name])[0]


# --- Mooncake -----------------------------------------------------------------------------------

def test_mooncake_blocks_equal_ids_equal_blocks_distinct_ids_distinct():
    assert block_ids(10) == block_ids(10) and len(block_ids(10)) == MOONCAKE_BLOCK_TOKENS
    blocks = {block_ids(h) for h in range(2000)}
    assert len(blocks) == 2000
    trace = MooncakeTrace(MOONCAKE)
    by_ids = {r.hash_ids: trace.job(i).prompt_ids for i, r in enumerate(trace.records)}
    a, b = by_ids[(10, 11, 12)], by_ids[(10, 11, 13)]
    assert a[:1024] == b[:1024] and a[1024:1028] != b[1024:1028]  # block 12 vs 13: their digits
    with pytest.raises(ValueError, match="hash id"):
        block_ids(-1)


def test_mooncake_replay_in_virtual_time_lengths_sharing_and_times():
    trace = MooncakeTrace(MOONCAKE)
    raw = _raw_mooncake()
    run = run_open(_single(), trace, OpenLoop(trace.times), ROUTING, log_requests=True)
    log = run.request_log
    assert log is not None and len(log) == len(raw) == len(run.records)
    for entry, record, row in zip(log, run.records, raw, strict=True):
        # exact lengths, from the simulator's own record
        assert entry.prompt_tokens == row["input_length"]
        assert entry.max_tokens == entry.generated == record.tokens == row["output_length"]
        assert entry.finish_reason == "length" and record.error is None
        # arrivals at the trace's timestamps (ms), relative to the first
        assert entry.at == pytest.approx((row["timestamp"] - raw[0]["timestamp"]) / 1000, abs=1e-9)
    # The prefix cache (one server, far from full: no eviction) gave each request the prefix its
    # hash ids share with an earlier one, in the simulator's 64-token cache blocks, less the last
    # token (always computed). The trace's arrivals are far enough apart that each earlier
    # prompt was in the cache (inserted when its prefill ended) before the next arrived.
    expected = []
    for j, row in enumerate(raw):
        shared = max((_shared_prefix(raw[i], row) for i in range(j)), default=0)
        expected.append(min(shared // CACHE_BLOCK_TOKENS * CACHE_BLOCK_TOKENS, row["input_length"] - 1))
    assert [e.cached_tokens for e in log] == expected
    # the sample exercises whole shared blocks and a partial one (1,300 tokens of [10, 11, 13])
    assert expected == [0, 1024, 0, 1536, 512, 0, 1280, 0]


@pytest.mark.parametrize(("time_scale", "rate_scale"), [(2.5, 1.0), (1.0, 4.0), (3.0, 2.0)])
def test_mooncake_arrivals_at_the_scaled_timestamps(time_scale, rate_scale):
    trace = MooncakeTrace(MOONCAKE, time_scale=time_scale, rate_scale=rate_scale)
    raw = _raw_mooncake()
    run = run_open(_single(), trace, OpenLoop(trace.times), ROUTING, log_requests=True)
    assert run.request_log is not None
    want = [(r["timestamp"] - raw[0]["timestamp"]) / 1000 * time_scale / rate_scale for r in raw]
    assert [e.at for e in run.request_log] == pytest.approx(want, abs=1e-9)
    assert [r.start for r in run.records] == pytest.approx(want, abs=1e-9)
    assert [e.prompt_tokens for e in run.request_log] == [r["input_length"] for r in raw]


def test_mooncake_input_past_its_blocks_and_bad_records(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 5, "input_length": 1100, "output_length": 3, "hash_ids": [1]}\n'
                    '{"timestamp": 9, "input_length": 100, "output_length": 2, "hash_ids": [1, 2]}\n')
    trace = MooncakeTrace(path)
    first, second = trace.job(0), trace.job(1)
    assert len(first.prompt_ids) == 1100 and len(second.prompt_ids) == 100
    assert first.prompt_ids[:100] == second.prompt_ids  # block 1, truncated
    assert first.body["max_tokens"] == 3 and first.body["ignore_eos"] is True
    assert trace.times == (0.0, 0.004)
    path.write_text('{"timestamp": 5, "input_length": 0, "output_length": 3, "hash_ids": []}\n')
    with pytest.raises(ValueError, match="input_length"):
        MooncakeTrace(path)
    path.write_text('{"timestamp": 5, "output_length": 3}\n')
    with pytest.raises(ValueError, match=":1:"):
        MooncakeTrace(path)


# --- SGLang's agentic trace ------------------------------------------------------------------

class _Capture(Workload):
    """A workload that remembers every job its scripts sent, by script."""

    def __init__(self, inner: Workload) -> None:
        super().__init__()
        self.inner = inner
        self.jobs: dict[int, list[Job]] = {}

    def script(self, index: int) -> Script:
        script = self.inner.script(index)
        value = None
        while True:
            try:
                action = script.send(value)
            except StopIteration:
                return
            if isinstance(action, Send):
                self.jobs.setdefault(index, []).extend(action.jobs)
            value = yield action


def test_agentic_prompt_ids_count_the_simulators_chat_tokens():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there you"},
                {"role": "assistant", "content": "hello"}, {"role": "tool", "content": ""}]
    ids = sum((message_ids(m["role"], m["content"]) for m in messages), ()) + GENERATION_PROMPT
    assert len(ids) == len(chat_prompt_text(messages).split())


def test_agentic_rounds_in_order_per_conversation():
    trace = AgenticTrace(AGENTIC)
    raw = json.loads(AGENTIC.read_text())["conversations"]
    # every conversation's rounds: its turns with messages, in order (the empty turn skipped)
    assert [len(c) for c in trace.conversations] == [3, 2, 1]
    capture = _Capture(trace)
    times = (0.0, 0.5, 0.5)
    run = run_open(_single(), capture, OpenLoop(times, unit="session"), ROUTING, log_requests=True)
    for n, arrival in enumerate(run.arrivals):
        jobs = capture.jobs[n]
        turns = [t for t in raw[n] if t["messages"]]
        assert arrival.requests == len(jobs) == len(turns)
        # each round sends the whole history: the previous round's prompt, its answer, then
        # the turn's new messages, in the trace's order
        sent = [m for m in jobs[-1].body["messages"] if m["role"] != "assistant"]
        want = [m if isinstance(m, dict) else {"role": "user", "content": m}
                for t in turns for m in (t["messages"] if isinstance(t["messages"], list)
                                         else [t["messages"]])]
        assert sent == want
        for before, after in zip(jobs, jobs[1:], strict=False):
            assert after.prompt_ids[:len(before.prompt_ids)] == before.prompt_ids
        # a round leaves when the previous answer is back (plus the turn's delay_s)
        records = arrival.records
        assert records[0].start == times[n]
        for k in range(1, len(records)):
            delay = turns[k].get("delay_s", 0.0)
            assert records[k].start == pytest.approx(records[k - 1].end + delay, abs=1e-9)
            assert records[k].start > records[k - 1].end or delay == 0
        assert all(r.tokens == 220 and r.error is None for r in records)  # SGLang's default
    # the simulator got exactly these prompts: the lengths of the jobs, in send order
    assert run.request_log is not None
    sent_order = sorted((r.sent, n, len(job.prompt_ids)) for n, a in enumerate(run.arrivals)
                        for r, job in zip(a.records, capture.jobs[n], strict=True))
    assert [e.prompt_tokens for e in run.request_log] == [length for _, _, length in sent_order]


def test_agentic_trace_refuses_what_it_cannot_replay(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"conversations": [[{"messages": [{"content": "no role"}]}]]}))
    with pytest.raises(ValueError, match="conversation 0, turn 0"):
        AgenticTrace(path)
    path.write_text(json.dumps({"conversations": [[{"messages": []}]]}))
    with pytest.raises(ValueError, match="no usable"):
        AgenticTrace(path)
    with pytest.raises(ValueError, match="no timestamps"):
        load_trace(AGENTIC, time_scale=2.0)


# --- the project's recorded requests -------------------------------------------------------------

def test_recorded_file_replayed_at_its_timestamps():
    trace = RecordedTrace(RECORDED, time_scale=2.0)
    assert trace.times == (0.0, 1.5, 4.0)  # sorted, scaled
    run = run_open(_single(), trace, OpenLoop(trace.times), ROUTING, log_requests=True)
    assert run.request_log is not None
    assert [e.at for e in run.request_log] == [0.0, 1.5, 4.0]
    assert [e.generated for e in run.request_log] == [12, 9, 20]  # max_tokens, in time order
    assert [r.tokens for r in run.records] == [12, 9, 20]


def test_recorded_file_without_timestamps_takes_a_rate(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    lines = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in line.items() if k != "timestamp"}) + "\n"
                            for line in lines))
    assert RecordedTrace(path).times is None
    code = main(["bench", "--sim", "--trace", str(path), "--request-rate", "inf", "--target",
                 "single-plain", "--no-progress"])
    text = capsys.readouterr().out
    assert code == 0 and "all requests at once" in text
    unstamped = {k: v for k, v in lines[1].items() if k != "timestamp"}
    path.write_text(json.dumps(lines[0]) + "\n" + json.dumps(unstamped) + "\n")
    with pytest.raises(ValueError, match="some lines only"):
        RecordedTrace(path)


def test_formats_are_detected():
    assert detect_format(MOONCAKE)[0] == "mooncake"
    assert detect_format(AGENTIC)[0] == "agentic"
    assert detect_format(RECORDED)[0] == "recorded"
    assert isinstance(load_trace(RECORDED), RecordedTrace)


# --- closed loop (what calibrate sweeps) ---------------------------------------------------------

def _sends(script) -> list[list[str]]:
    """Drive a script, answering each Send; the ids of what each Send sent, in order."""
    sent, value = [], None
    while True:
        try:
            action = script.send(value)
        except StopIteration:
            return sent
        value = None
        if isinstance(action, Send):
            sent.append([job.body["id"] for job in action.jobs])
            value = [Outcome(1) for _ in action.jobs]


def test_closed_loop_keeps_a_recorded_sessions_requests_in_order_on_one_client(tmp_path):
    """A recorded trace's requests grouped by x-session-id, in time order, each sent when the
    one before is answered; a request without a session is its own; past the end, again."""
    rows = [("a1", "s1", 0.0), ("b", None, 0.5), ("c1", "s2", 0.7), ("a2", "s1", 0.6),
            ("a3", "s1", 2.0), ("c2", "s2", 1.0)]
    path = tmp_path / "sessions.jsonl"
    path.write_text("".join(json.dumps({
        "timestamp": t, "path": "/v1/chat/completions",
        "body": {"id": rid, "messages": [{"role": "user", "content": rid}], "max_tokens": 4},
        **({"headers": {"x-session-id": sid}} if sid else {})}) + "\n" for rid, sid, t in rows))
    trace = load_trace(path)
    closed = closed_loop(trace)
    assert [_sends(closed.script(i)) for i in range(4)] == [
        [["a1"], ["a2"], ["a3"]], [["b"]], [["c1"], ["c2"]], [["a1"], ["a2"], ["a3"]]]
    assert trace.requests == 6 and trace.times is not None  # the times are there, and unused


def test_closed_loop_runs_other_traces_and_workloads_as_they_are():
    mooncake, agentic = MooncakeTrace(MOONCAKE), AgenticTrace(AGENTIC)
    assert closed_loop(mooncake) is mooncake and mooncake.requests == 8
    assert closed_loop(agentic) is agentic and agentic.requests == 6  # 3 + 2 + 1 rounds
    chat = make_workload("chat")
    assert closed_loop(chat) is chat


# --- the CLI ------------------------------------------------------------------------------------

def test_cli_replays_a_trace_in_virtual_time(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["bench", "--sim", "--trace", str(MOONCAKE), "--target", "single-plain",
                 "--trace-time-scale", "2", "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "open loop" in text and "the trace's times x2" in text
    assert "every run received exactly the max_tokens" in text
    data = json.loads(out.read_text())
    row = data["results"]["single-plain"][0]
    assert data["meta"]["open_loop"] is True and row["arrivals"] == row["completed"] == 8
    assert row["output_asked"] == sum(r["output_length"] for r in _raw_mooncake())
    assert row["offered_rate"] == pytest.approx(7 / 12.0)  # 8 arrivals over 6 s, x2


@pytest.mark.parametrize(("argv", "message"), [
    (["--workload", "agentic", "--request-rate", "1"], "give --session-rate"),
    (["--trace", str(MOONCAKE), "--request-rate", "1"], "its own arrival times"),
    (["--trace", str(AGENTIC), "--request-rate", "1"], "give --session-rate"),
    (["--trace", str(MOONCAKE), "--workload", "chat"], "replaces --workload"),
    (["--request-rate", "1", "--warmup", "5"], "closed-loop options"),
    (["--workload", "chat", "--trace-time-scale", "2", "--request-rate", "1"], "need --trace"),
    (["--request-rate", "0"], "> 0"),
])
def test_cli_refuses_what_an_open_loop_cannot_mean(argv, message, capsys):
    assert main(["bench", "--sim", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


# --- over HTTP ----------------------------------------------------------------------------------

async def test_http_replay_lengths_exact_against_the_simulator_and_the_gateway():
    """The Mooncake sample against the plain simulated server (a plain OpenAI-compatible URL),
    the agentic one through the gateway: every request's prompt and output lengths as the
    servers' usage reports them are the trace's (Mooncake) and the replay's own token view
    (agentic, the simulator's chat template)."""
    speed = 50.0
    async with asyncio.timeout(45), start_sim_pair(SimOptions(speed=speed)) as pair:
        async with aiohttp.ClientSession() as session:
            trace = MooncakeTrace(MOONCAKE)
            records, arrivals = await run_http_open(
                session, Target("plain", pair.urls["plain"]), trace, OpenLoop(trace.times), speed=speed)
            raw = _raw_mooncake()
            assert len(arrivals) == len(raw)
            for arrival, row in zip(arrivals, raw, strict=True):
                (record,) = arrival.records
                assert record.error is None
                assert record.prompt_tokens == row["input_length"]
                assert record.tokens == row["output_length"]
                assert record.start == arrival.scheduled  # latency from the schedule
            async with live_gateway(pair) as gateway:
                capture = _Capture(AgenticTrace(AGENTIC))
                records, arrivals = await run_http_open(
                    session, Target("gateway", gateway.url), capture,
                    OpenLoop((0.0, 0.0, 1.0), unit="session"), speed=speed)
                assert sum(a.requests for a in arrivals) == 6
                for n, arrival in enumerate(arrivals):
                    for record, job in zip(arrival.records, capture.jobs[n], strict=True):
                        assert record.error is None
                        assert record.prompt_tokens == len(job.prompt_ids)
                        assert record.tokens == job.max_tokens == 220
