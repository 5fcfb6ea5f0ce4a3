"""bench --sim's vLLM 0.33.0 targets (gateway/sim/vllm/profiles.py): the split vLLM pair, the
pair taking turns in sleep mode, and the single vLLM servers, in virtual time."""

import json
import random

import pytest

from gateway.bench.targets import VLLM_TARGETS, build_targets, caps
from gateway.bench.turns_virtual import Phase, TurnModel, run_virtual, turns_routing
from gateway.bench.workloads import Seed
from gateway.cli import main
from gateway.config import Routing, Turns
from gateway.sim.engine import Engine
from gateway.sim.engine import Request as EngineRequest
from gateway.sim.vllm import profiles as vllm_profiles
from gateway.sim.vllm import sleep as vllm_sleep
from tests.bench.test_turns_virtual import assert_never_both_holding

pytestmark = pytest.mark.timeout(120)


def _decode_steps(engine: Engine, requests: int) -> set[int]:
    """The draft steps of every decode step that ran exactly ``requests`` requests."""
    for i in range(requests):
        engine.submit(EngineRequest(f"{requests}-{i}", [1, 2, 3], 30))
    seen = set()
    while (step := engine.begin_step()) is not None:
        if step.kind == "decode" and len(step.seqs) == requests:
            seen.add(step.num_steps)
        engine.finish_step(step)
    return seen


def test_the_dynamic_target_chooses_its_draft_steps_by_the_batch_size():
    """v1/core/sched/scheduler.py:1709-1714 with issue #49548's schedule [[1,4,2],[5,512,0]]:
    k = 2 up to 4 scheduled requests, 0 above; the static targets draft k at every size."""
    (dynamic, static) = build_targets(["vllm-mtp-dynamic", "vllm-mtp-k2"], "h200")
    engine = Engine(dynamic.profiles["mtp"], random.Random(0))
    assert _decode_steps(engine, 1) == {2}
    assert _decode_steps(engine, 4) == {2}
    assert _decode_steps(engine, 6) == {0}
    assert _decode_steps(Engine(static.profiles["mtp"], random.Random(0)), 6) == {2}
    # k = 0 frees nothing: the dynamic server keeps the static k = 2 server's memory and cap
    assert dynamic.profiles["mtp"].effective_max_running == static.profiles["mtp"].effective_max_running


def test_vllms_mtp_server_is_not_capped_at_48_but_by_its_mamba_pool():
    """config/speculative.py never sets max_num_seqs (SGLang resets it to 48 with speculation)."""
    found = caps(build_targets(["single-mtp", "vllm-mtp", "vllm-mtp-k2"], "h200"))
    assert found["single-mtp"] == {"mtp": 48}
    profile = vllm_profiles.single("mtp", "h200")
    assert profile.resolved_max_running_requests == vllm_profiles.MAX_NUM_SEQS
    assert found["vllm-mtp"]["mtp"] == profile.mamba_slots // profile.mamba_slots_per_request > 48
    # a larger k reserves more per request, so fewer run
    assert found["vllm-mtp-k2"]["mtp"] < found["vllm-mtp"]["mtp"]


def test_bench_sim_runs_the_vllm_targets_and_the_vllm_pairs_verdict(tmp_path, capsys):
    out_json = tmp_path / "out.json"
    args = ["bench", "--sim", "--no-progress", "--workload", "chat", "--concurrency", "1,8",
            "--requests-per-level", "8", "--max-tokens", "40", "--hardware", "rtx-pro-6000",
            "--json", str(out_json)]
    code = main([*args, *(a for name in VLLM_TARGETS for a in ("--target", name))])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out_json.read_text())
    assert list(data["results"]) == list(VLLM_TARGETS)
    for name, rows in data["results"].items():
        assert [r["requests"] for r in rows] == [8, 8] and not any(r["errors"] for r in rows), name
    assert set(data["meta"]["running_caps"]["vllm-pair"]) == {"mtp", "plain"}
    assert "The pair (vllm-pair) against the best single server" in out


# --- the vLLM pair taking turns in sleep mode ---------------------------------------------------

CROSSOVER = 40  # fixed: no calibration


def _turns_run(phases, output_len, name="vllm-pair-turns"):
    (target,) = build_targets([name], "rtx-pro-6000", turn=TurnModel(crossover=CROSSOVER, payback_turns=0))
    run = run_virtual(Seed(output_len=output_len), Routing(), target.profiles,
                      phases=phases, turns=target.turns, turns_routing=turns_routing(Routing(), CROSSOVER),
                      log_steps=True)
    return target, run


def test_a_vllm_turn_costs_the_outgoing_servers_sleep_and_the_incoming_ones_wake():
    """A level-1 sleep copies the weights to a fresh host buffer and a wake copies them back
    (gateway/sim/vllm/sleep.py): ~18 s a turn, not SGLang's 1.5 s; nothing steps meanwhile."""
    sleep_wake = vllm_sleep.costs("rtx-pro-6000")
    target, run = _turns_run([Phase(2, 30.0), Phase(64, 60.0), Phase(2, 400.0)], 200)
    to_plain, back = run.turns[:2]
    assert (to_plain.to, back.to) == ("plain", "mtp")
    (mtp_sleep, mtp_wake), (plain_sleep, plain_wake) = sleep_wake["mtp"], sleep_wake["plain"]
    assert to_plain.settled_at - to_plain.released_at == pytest.approx(mtp_sleep + plain_wake)
    assert back.settled_at - back.released_at == pytest.approx(plain_sleep + mtp_wake)
    assert 17 < to_plain.settled_at - to_plain.released_at < 20
    # the decision's dwell is that of an 18 s turn: the holder keeps the memory that much longer
    assert target.turns.rules(Routing()).dwell() > 10 * TurnModel(payback_turns=0).rules(Routing()).dwell()
    assert_never_both_holding(run)


def test_a_vllm_turn_lets_running_streams_finish_and_ends_those_past_the_bound():
    """gateway/turns/state.py HANDOVERS["vllm"]: finish_streams, then the sleep; a stream still
    running after turns.finish_within_s is ended with an error, never continued (the sleeping
    server cannot take a continuation)."""
    _, short = _turns_run([Phase(8, 20.0), Phase(96, 60.0)], 300)  # each ends within the bound
    turn = short.turns[0]
    assert turn.continued == 0 and turn.ended == 0 and turn.finished_first > 0
    assert turn.released_at > turn.start  # MTP's streams finished before its sleep
    assert all(r.ok and r.tokens == 300 for r in short.records)
    _, long = _turns_run([Phase(8, 20.0), Phase(96, 60.0)], 6000)  # ~70 s on MTP: past the bound
    turn = long.turns[0]
    assert turn.continued == 0 and turn.ended > 0
    assert turn.released_at - turn.start == pytest.approx(Turns().finish_within_s, abs=0.2)
    cut = [r for r in long.records if not r.ok]
    assert len(cut) == turn.ended and all(r.error == "abort" and r.tokens < 6000 for r in cut)


def test_the_vllm_turns_pair_is_one_vllm_server_owning_the_gpus_at_each_end():
    """Plain sizes first on the empty GPUs (the single plain server's cap); MTP beside plain's
    leftovers, whose CUDA graphs stay on the GPU through a level-1 sleep."""
    found = caps(build_targets(["vllm-pair-turns", "vllm-pair-turns-k2", "vllm-plain", "vllm-mtp",
                                "vllm-mtp-k2", "vllm-pair"], "h200"))
    assert found["vllm-pair-turns"]["plain"] == found["vllm-plain"]["plain"]
    assert found["vllm-pair"]["mtp"] < found["vllm-pair-turns"]["mtp"] < found["vllm-mtp"]["mtp"]
    assert found["vllm-pair-turns-k2"]["mtp"] < found["vllm-mtp-k2"]["mtp"]
