"""A turns pair's memory state: the one record of which server holds the GPUs' memory, and of
each step of a turn or a settling in progress. Pure: no I/O, no clock (time is passed in).

    discovering ──discovered──▶ settling(plan) ──steps done──▶ holding(h) ──begin_turn──▶
         ▲                          │                             ▲         handing(h→t, plan)
         │ any step fails           │                             │               │
         └──────────────────────────┴─────────────────────────────┴── steps done ─┘
    discovered with nothing safe to do ──▶ stuck (discovery again after a while)

What each server's memory is, as far as the gateway knows (`Memory`):
    held       it owns its weights and KV cache (resumed, or never released)
    released   /release_memory_occupation answered 200 (or it was never resumed)
    releasing  a release was sent and no answer came (yet): held or released
    resuming   a resume was sent and no answer came (yet)
    unknown    nothing known (a gateway started without its journal)
    gone       it does not answer /ping: a dead process holds no GPU memory
    hung       alive, but its scheduler stopped answering in a resume (SGLang's resume
               without free memory never answers again): never sent anything more

The order of a turn, and why (SGLang 0.5.23): a release while requests run kills the server
(weight_updater.py:339-341), a second release or resume of the same tags kills it, and a
resume while the other holds the memory never answers. So a release or resume is sent only
from `held` / `released` respectively, exactly once, and never both servers hold.
After a failure, the facts above and fresh probes decide (gateway/turns/discovery.py): the
pair ends serving on the one server that holds the memory, or on the one that can take it.
What of this survives a restart: gateway/turns/journal.py.

A vLLM pair (`engine: vllm`) hands its memory over with sleep mode (`HANDOVERS`): one `sleep`
(level 1) in place of pause + release, one `wake_up` in place of resume + continue, with the
same facts (`releasing` while a sleep is unanswered, `resuming` while a wake is). Its running
streams finish first: the incoming server is asleep and a continuation needs what vLLM does
not serve (docs/turns.md). Nothing in sleep mode kills a server, but the same order holds: a
wake while the other holds fails (500, still asleep: v1/engine/core.py:1848-1851), and
arrivals sent to a sleeping server hang there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from gateway.config import ROLES, EngineName, Role
from gateway.upstream.engine.probe import FailureKind, Probe

Memory = Literal["held", "released", "releasing", "resuming", "unknown", "gone", "hung"]
MEMORIES: tuple[Memory, ...] = Memory.__args__  # type: ignore[attr-defined]
Phase = Literal["discovering", "settling", "holding", "handing", "stuck"]
PHASES: tuple[Phase, ...] = Phase.__args__  # type: ignore[attr-defined]
Action = Literal["stop_admitting", "move_unstarted", "running_streams", "finish_streams",
                 "keep_caches", "pause", "release", "sleep", "check_memory", "resume", "wake_up",
                 "continue", "check_ready", "check_speculation", "end_streams"]
ACTIONS: tuple[Action, ...] = Action.__args__  # type: ignore[attr-defined]
FAILURE_KINDS: tuple[FailureKind, ...] = FailureKind.__args__  # type: ignore[attr-defined]


def other(role: Role) -> Role:
    return "plain" if role == "mtp" else "mtp"


@dataclass(frozen=True, slots=True)
class Handover:
    """How one engine's server gives the memory up and takes it back, as steps."""

    streams: tuple[Action, ...]  # at a turn, on the outgoing server before it gives up
    give_up: tuple[Action, ...]  # its memory (the call that frees it is the last)
    take: Action  # the call that maps the incoming server's memory back
    serve: tuple[Action, ...]  # then, until it takes requests again
    needs: str  # what both servers must be started with


# SGLang: running streams continue on the paused incoming server (its tokenizer holds them
# until /continue_generation), the prefix cache is written out first, pause then release.
# vLLM: running streams finish first, one sleep (level 1; mode: gateway/upstream/engine/
# vllm.py SLEEP_MODE), one wake_up, then ready once /is_sleeping says awake (/health does not).
HANDOVERS: dict[EngineName, Handover] = {
    "sglang": Handover(streams=("running_streams", "keep_caches"), give_up=("pause", "release"),
                       take="resume", serve=("continue", "check_ready"),
                       needs="--enable-memory-saver"),
    "vllm": Handover(streams=("finish_streams",), give_up=("sleep",), take="wake_up",
                     serve=("check_ready",), needs="VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode"),
}
GIVES_UP: frozenset[Action] = frozenset({"release", "sleep"})  # answered 200: memory released
TAKES: frozenset[Action] = frozenset({"resume", "wake_up"})  # answered 200: memory held


@dataclass(frozen=True, slots=True)
class Step:
    action: Action
    role: Role  # the server it acts on; for the two stream steps, the one they leave

    def __str__(self) -> str:
        return f"{self.action}({self.role})"


@dataclass(frozen=True, slots=True)
class Failure:
    step: Step
    kind: FailureKind
    detail: str
    at: float


@dataclass(frozen=True, slots=True)
class PairMemory:
    phase: Phase
    memory: tuple[tuple[Role, Memory], ...]  # per role, in ROLES order
    plan: tuple[Step, ...] = ()  # the steps left; the first is the one in progress
    target: Role | None = None  # who holds the memory when the plan is done
    since: float = 0.0  # when the phase began
    step_since: float = 0.0  # when the step in progress began
    failure: Failure | None = None  # the latest failure (kept for /admin/state)
    failed_plans: int = 0  # plans in a row that failed since the pair last held
    speculation_lost: bool = False  # MTP came back with drafts that no longer pay
    avoid: Role | None = None  # a server that failed to take the memory: the other first
    cannot_turn: str = ""  # why no turn may start (the pair serves on its holder)
    why: str = ""  # stuck: what nothing safe could be done about
    engine: EngineName = "sglang"  # what the two servers are: which calls hand the memory over

    # --- reading -----------------------------------------------------------------------------

    def of(self, role: Role) -> Memory:
        return dict(self.memory)[role]

    @property
    def holder(self) -> Role | None:
        """The server that holds the memory, when one surely does."""
        held = [role for role, memory in self.memory if memory == "held"]
        return held[0] if len(held) == 1 else None

    @property
    def admitting(self) -> Role | None:
        """Where new requests may go now; None: they wait at the gateway."""
        return self.holder if self.phase == "holding" else None

    @property
    def step(self) -> Step | None:
        return self.plan[0] if self.phase in ("settling", "handing") and self.plan else None

    @property
    def source(self) -> Role | None:
        """The server a turn in progress leaves."""
        return other(self.target) if self.phase == "handing" and self.target else None


def initial(now: float, memory: Mapping[Role, Memory] | None = None,
            engine: EngineName = "sglang") -> PairMemory:
    """At start: what the journal says (else nothing), to be settled by discovery."""
    known = dict(memory or {})
    facts = tuple((role, known.get(role, "unknown")) for role in ROLES)
    return PairMemory("discovering", _after_restart(facts), since=now, step_since=now,
                      engine=engine)


def _after_restart(facts: tuple[tuple[Role, Memory], ...]) -> tuple[tuple[Role, Memory], ...]:
    # `hung` is a fact about a process that a restart of it ends: probes find it again.
    return tuple((role, "unknown" if memory == "hung" else memory) for role, memory in facts)


def _with(state: PairMemory, role: Role, memory: Memory) -> tuple[tuple[Role, Memory], ...]:
    return tuple((r, memory if r == role else m) for r, m in state.memory)


# --- a turn ----------------------------------------------------------------------------------

def turn_plan(source: Role, target: Role, engine: EngineName = "sglang") -> tuple[Step, ...]:
    """A turn in order (docs/turns.md), in the engine's calls (`HANDOVERS`).

    SGLang: the streams go to the target while it is paused: SGLang holds new requests in its
    tokenizer until /continue_generation (tokenizer_manager.py:938-939). `keep_caches`: the
    source, idle and not yet paused, finishes writing its prefix cache to its own store
    (HiCache): a paused scheduler writes nothing more, the release drops what is not written,
    and a release while a device-to-host copy of the KV runs kills the server
    (lab/results/hicache-probe). A server without HiCache passes the step at once.

    vLLM: unstarted streams wait in the sleeping target's queue until its wake (every pause
    mode queues new requests, v1/engine/core.py:958-970); running ones finish on the source
    (`finish_streams`) before its sleep."""
    handover = HANDOVERS[engine]
    steps = [Step("stop_admitting", source), Step("move_unstarted", source),
             *(Step(action, source) for action in (*handover.streams, *handover.give_up)),
             Step("check_memory", source),
             *(Step(action, target) for action in (handover.take, *handover.serve))]
    if target == "mtp":  # the draft weights can come back wrong without an error (#31674)
        steps.append(Step("check_speculation", target))
    return tuple(steps)


def can_turn_to(state: PairMemory, target: Role) -> bool:
    """A turn may start: the pair holds, and `target` is known released (not hung, gone or in
    doubt: resuming those could hang or kill it)."""
    return (state.phase == "holding" and state.holder == other(target)
            and state.of(target) == "released" and not state.cannot_turn)


def begin_turn(state: PairMemory, target: Role, now: float) -> PairMemory:
    """Hand the memory to `target` (see `can_turn_to`)."""
    if not can_turn_to(state, target):
        raise ValueError(f"no turn to {target} from {state.phase} (memory {dict(state.memory)})")
    return replace(state, phase="handing", plan=turn_plan(other(target), target, state.engine),
                   target=target,
                   since=now, step_since=now, failed_plans=0, why="")


def holder_lost(state: PairMemory, now: float) -> PairMemory:
    """The server holding the memory stopped answering while the pair held (the monitor found
    it down): discovery, which gives the memory to the other if the holder is gone."""
    if state.phase != "holding":
        raise ValueError(f"no holder to lose in {state.phase}")
    return replace(state, phase="discovering", since=now, step_since=now)


def reprobed(state: PairMemory, role: Role, probe: Probe) -> PairMemory:
    """While the other holds, a server found gone or hung is probed again: restarted and
    paused beside the holder, it holds nothing and may take a turn again."""
    if state.phase != "holding" or state.holder != other(role):
        return state
    if state.of(role) in ("gone", "hung") and probe.alive and probe.scheduler_answers \
            and not probe.ready:
        return replace(state, memory=_with(state, role, "released"))
    return state


def sending(state: PairMemory) -> PairMemory:
    """The step in progress is about to send its call: a release or a resume (a sleep or a
    wake) is in doubt from here until its answer (the journal says so before the call goes out)."""
    step = state.step
    if step is None or step.action not in GIVES_UP | TAKES:
        return state
    doubt: Memory = "releasing" if step.action in GIVES_UP else "resuming"
    return replace(state, memory=_with(state, step.role, doubt))


def step_done(state: PairMemory, now: float) -> PairMemory:
    """The step in progress succeeded: its effect on the memory, then the next step; after
    the last, the pair holds with its target."""
    step = state.step
    if step is None:
        raise ValueError(f"no step in progress ({state.phase})")
    memory = state.memory
    if step.action in GIVES_UP:
        memory = _with(state, step.role, "released")
    elif step.action in TAKES:
        memory = _with(state, step.role, "held")
    rest = state.plan[1:]
    if rest:
        return replace(state, memory=memory, plan=rest, step_since=now)
    return replace(state, phase="holding", memory=memory, plan=(), since=now, step_since=now,
                   failed_plans=0, avoid=None)


def step_failed(state: PairMemory, kind: FailureKind, detail: str, now: float, *,
                sent: bool = True) -> PairMemory:
    """The step in progress failed; the pair goes back to discovery, with what the failure
    tells about the memory. `sent`: the call may have reached the server (False: the
    connection was refused, so nothing happened there). `gone`: the connection was refused
    or lost; whether the process is gone, the probes say.

    A failed speculation check is the one failure that does not stop the pair: MTP holds the
    memory and answers correctly, only slower than it should; it is said and remembered, and
    the turn back to plain is the decision's to make. Only an accept length measured below the
    minimum (`check`) is a lost speculation: a check whose request failed (an error, no answer,
    the connection lost) measured nothing, so it is said, and MTP may be wished for again."""
    step = state.step
    if step is None:
        raise ValueError(f"no step in progress ({state.phase})")
    failure = Failure(step, kind, detail, now)
    if step.action == "check_speculation":
        done = step_done(state, now)
        return replace(done, failure=failure, speculation_lost=state.speculation_lost or kind == "check")
    memory = state.memory
    taking = step.action in ("check_memory", "resume", "wake_up", "continue", "check_ready")
    avoid = state.target if taking else state.avoid
    current = state.of(step.role)
    if current in ("releasing", "resuming") and (not sent or kind == "error"):
        # Refused before it was sent, or SGLang answered with an error
        # (http_server.py:1581-1583), or vLLM's wake failed and left it asleep
        # (v1/executor/abstract.py:424-435): the call did not happen. Otherwise (no answer, or the
        # connection lost after sending) it stays in doubt; the probes decide, and a dead
        # process holds nothing.
        memory = _with(state, step.role, "held" if current == "releasing" else "released")
    return replace(state, phase="discovering", memory=memory, plan=(), target=None, since=now,
                   step_since=now, failure=failure, failed_plans=state.failed_plans + 1,
                   avoid=avoid)
