"""After a failure, at start, or for a stuck pair: what the known facts of each server's
memory (gateway/turns/state.py) and fresh probes make safe. The pair ends with a plan that
leaves one server holding the memory and admitting, or `stuck` when no call is safe (a
release or resume in doubt, nothing that can take the memory). Pure: no I/O, no clock."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from gateway.config import ROLES, Role
from gateway.turns.state import HANDOVERS, Handover, Memory, PairMemory, Step, other
from gateway.upstream.engine.probe import Probe

SETTLE_ATTEMPTS = 3  # plans in a row that failed before the pair is stuck (retried slowly)


def rediscover(state: PairMemory, now: float) -> PairMemory:
    """A stuck pair, after a while: probe again, with a fresh count of attempts."""
    if state.phase != "stuck":
        raise ValueError(f"rediscovery from {state.phase}")
    return replace(state, phase="discovering", failed_plans=0, since=now, step_since=now)


def resolve(memory: Memory, probe: Probe) -> Memory:
    """One server's memory from what was known and what the probe found."""
    if not probe.alive:
        return "gone"
    if probe.asleep is not None and probe.scheduler_answers:
        # it says (vLLM's /is_sleeping, answered after any sleep or wake sent before it)
        return "released" if probe.asleep else "held"
    if memory == "releasing":
        return "released" if probe.scheduler_answers else "releasing"
    if memory == "resuming":
        return "held" if probe.scheduler_answers else "hung"
    if memory in ("unknown", "gone", "hung") and probe.ready:
        return "held"  # it takes requests: it holds its memory
    if memory in ("gone", "hung"):
        return "unknown"  # restarted: paused or not, nothing known of it
    return memory


def discovered(state: PairMemory, probes: Mapping[Role, Probe], preferred: Role, now: float,
               *, memory_free: bool | None = None) -> PairMemory:
    """Settle the pair from the facts and fresh probes: the plan that ends with one server
    holding the memory and admitting, or `stuck` when no call is safe.

    `memory_free`: the GPUs' memory is free (NVML, where visible; None: not visible): then a
    paused server of unknown state holds nothing."""
    if state.phase != "discovering" and state.phase != "stuck":
        raise ValueError(f"discovery from {state.phase}")
    facts = {role: resolve(state.of(role), probes[role]) for role in ROLES}
    held = [role for role in ROLES if facts[role] == "held"]
    for role in ROLES:  # a paused server beside one that holds (or free GPUs) holds nothing
        if facts[role] == "unknown" and (len(held) == 1 or memory_free):
            facts[role] = "released"
    memory = tuple((role, facts[role]) for role in ROLES)
    base = replace(state, memory=memory, since=now, step_since=now, cannot_turn="")
    without = [role for role in ROLES if probes[role].memory_saver is False]
    if without:  # its release would free nothing, and the other's resume would then hang
        base = replace(base, cannot_turn=f"{', '.join(without)} runs without "
                       f"{HANDOVERS[state.engine].needs}: a turns pair needs it on both servers")
    if state.failed_plans >= SETTLE_ATTEMPTS:
        return replace(base, phase="stuck", plan=(), target=None,
                       why=f"{state.failed_plans} settling plans failed in a row")
    if state.avoid is not None:
        preferred = other(state.avoid)
    plan, target, why = _settle_plan(facts, probes, preferred, HANDOVERS[state.engine])
    if target is None:
        return replace(base, phase="stuck", plan=(), target=None, why=why)
    if not plan:
        return replace(base, phase="holding", plan=(), target=target, failed_plans=0, why="",
                       avoid=None)
    return replace(base, phase="settling", plan=plan, target=target, why="")


def _settle_plan(facts: Mapping[Role, Memory], probes: Mapping[Role, Probe], preferred: Role,
                 handover: Handover) -> tuple[tuple[Step, ...], Role | None, str]:
    doubt = [role for role in ROLES if facts[role] in ("releasing", "unknown")]
    held = [role for role in ROLES if facts[role] == "held"]
    steps: list[Step] = []
    if len(held) == 2:  # both resident (started unparked): the one not wanted gives way
        holder = preferred
        steps += [Step(action, other(holder)) for action in handover.give_up]
    elif len(held) == 1:
        holder = held[0]
    else:
        if doubt:
            names = ", ".join(f"{role} ({facts[role]})" for role in doubt)
            return (), None, (f"cannot tell whether {names} holds the memory: resuming the other "
                              "could hang it, so the pair waits (a journal, turns.state_file, "
                              "or NVML tells)")
        takers = [role for role in ROLES if facts[role] == "released"]
        if not takers:
            states = ", ".join(f"{role} {facts[role]}" for role in ROLES)
            return (), None, f"no server can take the memory ({states})"
        holder = preferred if preferred in takers else takers[0]
        steps += [Step("check_memory", holder), Step(handover.take, holder)]
    if steps or not probes[holder].ready:
        steps += [Step(action, holder) for action in handover.serve]
    if any(step.action == handover.take for step in steps) and holder == "mtp":
        steps.append(Step("check_speculation", holder))
    if probes[other(holder)].alive:  # what waits on the other server comes to the holder;
        # what was continued there (a hand-off at a failed turn) cannot go on: it ends, in
        # its API's shape, rather than wait on a server that will not serve
        steps += [Step("move_unstarted", other(holder)), Step("end_streams", other(holder))]
    return tuple(steps), holder, ""
