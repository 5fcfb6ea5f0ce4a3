"""A burst hands 24 running streams from MTP to plain at a turn: all end whole from plain,
none waits for MTP.

The functional facts are asserted at any speed; the timing is only recorded. For the figures
in lab/results/bench/handoff-burst.md, run it at the modelled GPU's own speed:

    HANDOFF_BURST_SPEED=1 HANDOFF_BURST_REPORT=lab/results/bench/handoff-burst.md \\
        python -m pytest -q -p no:cacheprovider tests/test_continue_burst.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.sim.profile import load_profiles
from gateway.sim.server import SimOptions, start_sim_pair
from tests.conftest import live_gateway
from tests.live import wait_until

MODEL = "Qwen/Qwen3.5-122B-A10B"
STREAMS = 24
PROMPT_WORDS = 1000
LIMIT = 300
BEFORE = 50  # tokens each stream has when the turn comes
SPEED = float(os.environ.get("HANDOFF_BURST_SPEED", "4"))
REPORT = os.environ.get("HANDOFF_BURST_REPORT")


class Reader:
    """One SDK stream: its text, and when each piece arrived."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.text, self.at, self.finish, self.usage = stream, [], [], None, None

    def words(self) -> int:
        return len("".join(self.text).split())

    async def run(self) -> None:
        async for chunk in self.stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    self.text.append(choice.delta.content)
                    self.at.append(time.monotonic())
                self.finish = choice.finish_reason or self.finish
            self.usage = chunk.usage or self.usage


@pytest.mark.timeout(120)
async def test_a_burst_of_24_running_streams_goes_on_on_plain_at_a_turn() -> None:
    profiles = load_profiles()
    profiles["mtp"] = dataclasses.replace(profiles["mtp"], max_running_requests=STREAMS)
    options = SimOptions(speed=SPEED, profiles=profiles, shared_device=False)
    async with start_sim_pair(options) as pair, \
            live_gateway(pair, routing={"policy": "mtp-only"}) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)

        async def open_one(i: int) -> Reader:  # each its own prompt: no prefix shared on plain
            words = " ".join([f"w{i}"] + ["context"] * (PROMPT_WORDS - 1))
            return Reader(await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=LIMIT,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}))
        readers = await asyncio.gather(*(open_one(i) for i in range(STREAMS)))
        tasks = [asyncio.create_task(r.run()) for r in readers]
        await wait_until(lambda: all(r.words() >= BEFORE for r in readers), timeout=60)
        mtp, plain = (gateway.pool.backends[n] for n in ("mtp", "plain"))
        assert mtp.inflight == STREAMS and plain.inflight == 0
        started = time.monotonic()
        handed = await gateway.runtime.proxy.in_flight.continue_running(mtp, plain, timeout_s=60)
        returned = time.monotonic() - started
        assert handed.continued == STREAMS and not handed.staying and not handed.failed
        engine = pair.servers["mtp"].live.engine
        await wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0, timeout=5)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)
        gaps = []
        for reader in readers:
            assert reader.finish == "length" and reader.usage.completion_tokens == LIMIT
            assert len("".join(reader.text).split()) == LIMIT  # nothing repeated or lost
            after = next(i for i, t in enumerate(reader.at) if t > started)
            gaps.append(reader.at[after] - reader.at[after - 1])
        assert plain.inflight == 0 and gateway.pool.backends["mtp"].circuit.failures == 0
        await client.close()
    if REPORT:
        answered = [len("".join(piece for piece, at in zip(r.text, r.at, strict=True)
                                if at <= started).split()) for r in readers]
        prompts = [r.usage.prompt_tokens for r in readers]
        _report(Path(REPORT), profiles["plain"], gaps, returned, prompts, answered)


def _report(path: Path, plain: Any, gaps: list[float], returned: float, prompts: list[int],
            answered: list[int]) -> None:
    tokens = sum(prompts) + sum(answered)  # each continuation's prompt: the original + the answer
    steps = -(-tokens // plain.chunked_prefill_size)
    modelled = steps * plain.prefill_overhead_ms / 1000 + tokens * plain.prefill_ms_per_1k / 1e6
    gaps.sort()
    path.write_text(
        "# A burst handed off at a turn: 24 running streams from MTP to plain\n\n"
        f"Measured with `HANDOFF_BURST_SPEED={SPEED:g} HANDOFF_BURST_REPORT={path} python -m pytest "
        "-q -p no:cacheprovider tests/test_continue_burst.py` (the simulated pair at the modelled "
        "GPU's own speed, the gateway and the SDK clients on this 2-core machine, shared).\n\n"
        f"{STREAMS} chat streams of {prompts[0]}-token prompts (each its own) run on MTP; at "
        f"{min(answered)}-{max(answered)} tokens of answer each, `InFlight.continue_running(mtp, plain)` "
        "continues them on plain "
        f"(chat `continue_final_message`, max_tokens {LIMIT} less what was generated). All "
        f"{STREAMS} end whole from plain (`length`, exactly {LIMIT} tokens, as many words); "
        "MTP has nothing running or waiting once continue_running returns.\n\n"
        "| figure | seconds |\n|---|---:|\n"
        f"| continue_running returned (every continuation's first event in) | {returned:.2f} |\n"
        f"| a stream's pause at the seam: min | {gaps[0]:.2f} |\n"
        f"| median | {gaps[len(gaps) // 2]:.2f} |\n"
        f"| max | {gaps[-1]:.2f} |\n"
        f"| plain's modelled re-prefill of all {tokens:,} tokens ({steps} chunked steps, "
        f"the simulator's plain profile) | {modelled:.2f} |\n\n"
        f"The {returned - modelled:.2f} s above the modelled re-prefill are the gateway's and the "
        "simulator's (24 `/v1/tokenize` round trips and 24 continuations, one event loop each, "
        "on a shared 2-core machine; not profiled). No stream waited for MTP: the pause at the "
        "seam is plain's prefill of the continued prompts, the longest the whole batch's.\n")
