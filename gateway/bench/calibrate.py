"""Calibration: find the crossover in two measured curves, write it into config.yaml in place,
and turn the curves into a simulator profile.

The crossover rule (``find_crossover``)
---------------------------------------
Inputs: per measured concurrency C, each backend's aggregate tok/s and its user-visible
per-request tok/s (output tokens / summed e2e, queueing included: above MTP's running cap its
requests wait for a slot, and their fast decode is not what their users get).

1. For each of the two figures take the difference d(C) = MTP - plain. Its *crossing* is the
   lowest measured level C_hi with d <= 0 there and at every higher level (one noisy level
   cannot pull it down). With the level C_lo just below it (d > 0 there), the equal point is
   interpolated linearly: C* = C_lo + (C_hi - C_lo) * d(C_lo) / (d(C_lo) - d(C_hi)). When plain
   already wins at the lowest level, C* = that level - 1; when it never wins, there is none.
2. The objective picks one of the two C* (``--objective``, both are always printed):
   ``aggregate`` (the default) is where plain starts serving more tokens per second in total:
   past it, MTP's faster requests cost the pair capacity. It is the figure config.yaml's
   default crossover is stated in (31 on the simulated seed pair: docs/results.md, "Calibrating
   against the simulator").
   ``per-request`` is where MTP's requests stop being faster for their users (queueing
   included); choose it when each request's speed matters more than the total.
3. ``routing.crossover`` is compared with live concurrency *not counting the new request*:
   with crossover X, X closed-loop clients stay on MTP and the (X+1)-th request goes to plain.
   So the value is floor(C*): the last concurrency at which MTP is still at least as good.
4. Only when the config has ``capacity_guard: true`` is it capped at MTP's effective running
   cap (``/server_info``): above the cap the guard sends the overflow to plain while MTP is
   still busy, and the two servers then time-slice one GPU, slower than plain alone (virtual
   time, seed workload, crossover 32 with the guard: 0.79 x plain-only at C=32). Without the
   guard MTP queues past its cap, which pays up to the crossing.
5. The accept length MTP reported during the sweep (``/server_info``) is written as
   ``reference_accept_length`` when the config has that key: the gateway scales the crossover
   by live accept length / reference.

Hysteresis: kept unless it no longer fits under the new crossover (it must be smaller, and a
band wider than half the crossover would hold plain mode at loads where MTP is clearly better);
then it becomes max(1, crossover // 4).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, TypedDict

from gateway.bench.stats import LevelResult
from gateway.sim.profile import Profile
from gateway.turns.decision import measured_gain_per_crossover

if TYPE_CHECKING:  # annotations only: estimated_singles imports the sweep when it runs
    from gateway.bench.levels import LevelPlan
    from gateway.bench.workloads import Workload
    from gateway.config import Routing


@dataclass(frozen=True)
class Crossing:
    level: float | None  # interpolated equal point C*, None when plain never wins
    first_plain_level: int | None  # the measured level C_hi


def crossing(levels: Sequence[int], mtp: Sequence[float], plain: Sequence[float]) -> Crossing:
    """Where plain overtakes MTP for good on one figure (rule step 1)."""
    # A level where either side had no successful request (NaN) says nothing: left out.
    measured = [(c, m - p) for c, m, p in zip(levels, mtp, plain, strict=True) if not math.isnan(m - p)]
    levels, diffs = [c for c, _ in measured], [d for _, d in measured]
    first = None
    for i in range(len(levels) - 1, -1, -1):
        if diffs[i] <= 0:
            first = i
        else:
            break
    if first is None:
        return Crossing(None, None)
    if first == 0:
        return Crossing(float(max(levels[0] - 1, 0)), levels[0])
    lo, hi = levels[first - 1], levels[first]
    d_lo, d_hi = diffs[first - 1], diffs[first]
    return Crossing(lo + (hi - lo) * d_lo / (d_lo - d_hi), hi)


OBJECTIVES = {  # --objective: which crossing becomes routing.crossover, and what it optimises
    "aggregate": "plain serves more tokens per second in total past it",
    "per-request": "MTP's requests are no longer faster for their users past it",
}
DEFAULT_OBJECTIVE = "aggregate"


@dataclass(frozen=True)
class CrossoverResult:
    crossover: int | None  # the value for routing.crossover (None: plain never wins)
    uncapped: int | None
    aggregate: Crossing
    per_request: Crossing
    mtp_cap: int | None
    objective: str = DEFAULT_OBJECTIVE

    def explain(self) -> str:
        def fmt(name: str, c: Crossing) -> str:
            if c.level is None:
                return f"{name} crossing: none (plain never overtakes MTP in the measured range)"
            return (f"{name} crossing: equal at C = {c.level:.1f} (plain ahead from the measured "
                    f"level {c.first_plain_level} on) -> crossover {max(1, math.floor(c.level))}")

        default = " (the default)" if self.objective == DEFAULT_OBJECTIVE else ""
        lines = [fmt("aggregate tok/s", self.aggregate),
                 fmt("user-visible per-request tok/s", self.per_request),
                 f"objective: {self.objective}{default}: {OBJECTIVES[self.objective]}"]
        if self.crossover is None:
            lines.append(f"no crossover: by the {self.objective} objective MTP is as good or better "
                         "at every measured level")
        else:
            capped = (f", capped at MTP's effective running cap {self.mtp_cap} (uncapped {self.uncapped})"
                      if self.uncapped is not None and self.crossover < self.uncapped else "")
            lines.append(f"chosen: the {self.objective} crossing, crossover = {self.crossover}: MTP up "
                         f"to {self.crossover} requests in flight, plain from {self.crossover + 1}{capped}")
        return "\n".join(lines)


def find_crossover(mtp: Sequence[LevelResult], plain: Sequence[LevelResult],
                   mtp_cap: int | None = None, objective: str = DEFAULT_OBJECTIVE) -> CrossoverResult:
    by_plain = {r.concurrency: r for r in plain}
    pairs = [(m, by_plain[m.concurrency]) for m in sorted(mtp, key=lambda r: r.concurrency)
             if m.concurrency in by_plain]
    if not pairs:
        raise ValueError("no level measured on both backends")
    levels = [m.concurrency for m, _ in pairs]
    agg = crossing(levels, [m.aggregate_tps for m, _ in pairs], [p.aggregate_tps for _, p in pairs])
    per = crossing(levels, [m.user_tps for m, _ in pairs], [p.user_tps for _, p in pairs])
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    chosen = agg if objective == "aggregate" else per
    if chosen.level is None:
        return CrossoverResult(None, None, agg, per, mtp_cap, objective)
    uncapped = max(1, math.floor(chosen.level))
    crossover = min(uncapped, mtp_cap) if mtp_cap else uncapped
    return CrossoverResult(crossover, uncapped, agg, per, mtp_cap, objective)


def gain_past_crossover(mtp: Sequence[LevelResult], plain: Sequence[LevelResult],
                        crossover: int) -> float | None:
    """``turns.gain_per_crossover`` from the curves: plain's aggregate over MTP's at the level
    measured past the crossover nearest twice it (None: no level measured past it)."""
    by_plain = {r.concurrency: r for r in plain}
    past = [m for m in mtp if m.concurrency > crossover and m.concurrency in by_plain]
    if not past:
        return None
    level = min(past, key=lambda m: abs(m.concurrency - 2 * crossover))
    plain_tps = by_plain[level.concurrency].aggregate_tps
    return measured_gain_per_crossover(level.concurrency, crossover, plain_tps, level.aggregate_tps)


def suggested_hysteresis(crossover: int, current: int) -> int:
    if current < crossover and current <= crossover // 2:
        return current
    return max(1, crossover // 4) if crossover > 1 else 0


# --- editing config.yaml in place ------------------------------------------------------------

_TOP_KEY = re.compile(r"^(?P<key>[A-Za-z_][\w-]*)\s*:(?P<rest>.*)$")


def set_routing_values(text: str, values: Mapping[str, int | float | str], section: str = "routing") -> str:
    """Set keys of the top-level ``routing:`` block (or ``section``) in YAML text, touching
    nothing else.

    A key's value is replaced on its own line, keeping indentation and any trailing comment;
    a missing key is added at the top of the block; a missing block is appended.
    """
    lines = text.splitlines(keepends=True)
    start = end = None
    for i, line in enumerate(lines):
        match = _TOP_KEY.match(line)
        if start is None and match and match["key"] == section:
            rest = match["rest"].split("#", 1)[0].strip()
            if rest:
                raise ValueError(f"the {section} section is written inline; edit it by hand")
            start = i
        elif start is not None and match:
            end = i
            break
    if start is None:
        block = f"{section}:\n" + "".join(f"  {k}: {v}\n" for k, v in values.items())
        return text + ("" if not text or text.endswith("\n") else "\n") + block
    end = len(lines) if end is None else end
    indent = "  "
    for line in lines[start + 1:end]:
        m = re.match(r"^(\s+)[A-Za-z_]", line)
        if m:
            indent = m.group(1)
            break
    for key, value in values.items():
        pattern = re.compile(rf"^(?P<lead>{re.escape(indent)}{re.escape(key)}\s*:[ \t]*)(?P<value>[^#\r\n]*?)"
                             rf"(?P<tail>[ \t]*(#[^\r\n]*)?)(?P<eol>\r?\n?)$")
        for i in range(start + 1, end):
            m = pattern.match(lines[i])
            if m:
                lines[i] = f"{m['lead']}{value}{m['tail']}{m['eol'] or ''}"
                break
        else:
            lines.insert(start + 1, f"{indent}{key}: {value}\n")
            end += 1
    return "".join(lines)


# --- measured curves -> simulator profile ----------------------------------------------------

def accept_prob_for(accept_length: float, num_steps: int) -> float:
    """Per-draft acceptance p with 1 + p + p^2 + ... + p^num_steps = accept_length."""
    target = max(1.0, min(accept_length, num_steps + 1.0))
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**k for k in range(num_steps + 1)) < target:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)


class _FittedFields(TypedDict, total=False):
    """What fit_profile replaces in the base profile."""

    accept_prob: float
    accept_prob_repetitive: float
    num_steps: int
    step_ms: tuple[tuple[int, float], ...]
    max_running_requests: int
    mamba_slots: int | None


def fit_profile(base: Profile, results: Sequence[LevelResult], cap: int | None,
                accept_length: float | None = None, num_steps: int | None = None,
                greedy_repetitive: bool = True) -> Profile:
    """A profile that replays measured per-request decode speeds.

    The decode step of a batch b emits ``tokens_per_step`` tokens per request (1 without
    speculation, the accept length with it), so step_ms(b) = tokens_per_step * 1000 /
    per-request tok/s measured at concurrency b (levels above the cap run a batch of ``cap``
    and are skipped). Caps come from /server_info; the rest (prefill cost, cache) from ``base``.
    """
    steps = num_steps or base.num_steps
    tokens_per_step = 1.0
    fields: _FittedFields = {}
    if base.speculative:
        tokens_per_step = accept_length or (1.0 + base.accept_prob_repetitive * steps)
        if accept_length:
            key: Literal["accept_prob_repetitive", "accept_prob"] = (
                "accept_prob_repetitive" if greedy_repetitive else "accept_prob")
            fields[key] = accept_prob_for(accept_length, steps)
        fields["num_steps"] = steps
    table: dict[int, float] = {}
    for r in sorted(results, key=lambda r: r.concurrency):
        batch = min(r.concurrency, cap) if cap else r.concurrency
        if batch in table or math.isnan(r.per_request_tps) or r.per_request_tps <= 0:
            continue
        table[batch] = round(tokens_per_step * 1000.0 / r.per_request_tps, 3)
    if not table:
        raise ValueError("no usable per-request figure to fit a profile")
    fields["step_ms"] = tuple(sorted(table.items()))
    if cap:
        fields["max_running_requests"] = cap
        fields["mamba_slots"] = None
    return replace(base, **fields)


# --- the pair against one server owning the GPUs ---------------------------------------------

PAIR_BEST = "pair"


def pair_best(mtp: Sequence[LevelResult], plain: Sequence[LevelResult]) -> list[LevelResult]:
    """Per level, the pair's better server by aggregate tok/s, each measured alone: what ideal
    routing could reach. An upper bound for the gateway, which pays for switching and, while
    both servers run, for time-slicing the GPU."""
    by_plain = {r.concurrency: r for r in plain}
    rows = []
    for m in sorted(mtp, key=lambda r: r.concurrency):
        p = by_plain.get(m.concurrency)
        if p is None:
            continue
        best = p if _finite(p.aggregate_tps) > _finite(m.aggregate_tps) else m
        rows.append(replace(best, target=PAIR_BEST, share={best.target: 1.0}))
    return rows


def _finite(x: float) -> float:
    return -math.inf if x is None or math.isnan(x) else x


def fitted_pair(base: Mapping[str, Profile], results: Mapping[str, Sequence[LevelResult]],
                caps: Mapping[str, int | None], accept_length: float | None, num_steps: int | None,
                greedy_repetitive: bool) -> dict[str, Profile]:
    """The measured curves as simulator profiles (what --profile-out saves)."""
    return {name: fit_profile(base[name], results[name], caps[name],
                              accept_length=accept_length if name == "mtp" else None,
                              num_steps=num_steps if name == "mtp" else None,
                              greedy_repetitive=greedy_repetitive)
            for name in ("mtp", "plain")}


def estimated_singles(fitted: Mapping[str, Profile], hardware: str,
                      workload_factory: Callable[[], Workload], plans: Sequence[LevelPlan],
                      routing: Routing) -> dict[str, list[LevelResult]]:
    """One server owning the GPUs, in virtual time: the pair's measured step times with the
    memory such a server would have (gateway.sim.memory on ``hardware``). Its steps above the
    pair's running caps were never measured: they follow the last measured segment. The
    adaptive server is derived from MTP's one-step table, so only when MTP ran one step."""
    from gateway.bench.targets import build_targets, run_target_sweep

    names = ["single-plain", "single-mtp"] + (["single-adaptive"] if fitted["mtp"].num_steps == 1 else [])
    targets = build_targets(names, hardware, pair=fitted)
    return run_target_sweep(workload_factory, plans, routing, targets)
