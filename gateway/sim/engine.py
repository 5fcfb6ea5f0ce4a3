"""The engine model of one SGLang server, independent of HTTP and of any clock.

One module of ~450 lines on purpose: one step's decision reads the waiting queue, the running
batch, the prefix cache and the memory together; they have one owner here.

A driver (virtual time in :mod:`gateway.sim.virtual`, real time in :mod:`gateway.sim.live`)
repeatedly calls :meth:`Engine.begin_step`, waits ``step.duration_s`` on its clock (and on the
shared device), then calls :meth:`Engine.finish_step` and delivers the returned outputs.

Scheduling follows SGLang's: a FIFO waiting queue; a running set bounded by the profile's
effective cap; a prefill step (chunked to ``chunked_prefill_size`` uncached tokens) whenever a
request is being prefilled or can be admitted, which delays the decode of everything running;
otherwise one decode step for the whole running batch. With speculation each request's decode
step emits ``accepted drafts + 1`` tokens at once, as one SSE chunk does in SGLang.

The memory saver's engine operations (gateway/sim/saver.py drives them): ``paused`` stops the
steps (scheduler.py:2034, the event loop skips batches while ``_engine_paused``), ``retract``
puts every admitted request back in the waiting queue, to be prefilled again (prompt and the
tokens it generated) when it is admitted next (scheduler.py:5848-5919), ``flush_cache`` empties
the prefix cache (a release of the KV cache, weight_updater.py:365-366).
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from gateway.sim.adaptive import AdaptiveSteps
from gateway.sim.profile import Profile
from gateway.sim.vllm.dynamic import ScheduledSteps

# Prefix-cache granularity in tokens: a prompt is cached in whole blocks, like paged KV.
CACHE_BLOCK_TOKENS = 64
# Windows for the "recent" figures SGLang reports (it logs every 40 decode batches).
RECENT_STEPS = 40


@dataclass(frozen=True)
class Request:
    """What the engine needs to know about one generation request."""

    rid: str
    prompt: Sequence[int]
    output_len: int
    greedy: bool = False  # temperature 0: on a repeated-token prompt every draft is right


class Output(NamedTuple):
    """What one step produced for one request: new tokens and/or the end of it.

    A named tuple, not a frozen dataclass: a virtual bench builds one per running request per
    step (~800k in a chat sweep), and a frozen dataclass's __init__ costs ~4x a tuple's."""

    rid: str
    tokens: int
    first: bool = False
    finish_reason: str | None = None  # "length" when output_len is reached, "abort" otherwise


@dataclass(eq=False, slots=True)  # identity, not field equality: pools hold distinct requests
class _Seq:
    request: Request
    accept_prob: float
    uncached: int = 0  # prompt tokens still to compute in prefill
    generated: int = 0
    abort_at_step_end: bool = False
    gone: bool = False  # aborted while a step that contains it was running
    retracted: bool = False  # back in the queue after running: its next prefill re-computes it all
    loading: bool = False  # queued, waiting for its stored prefix to load (HiCache prefetch)
    stored: int = 0  # prompt tokens it starts from, loaded from the server's HiCache
    reused: int = 0  # prompt tokens it started from at admission (device or store): not new


@dataclass(eq=False)
class Step:
    """A step in flight: which sequences it covers and how long it takes on the device."""

    kind: str  # "prefill" or "decode"
    duration_s: float
    seqs: list[_Seq]
    prefill_tokens: list[int] = field(default_factory=list)  # per seq, prefill steps only
    aborting: list[_Seq] = field(default_factory=list)  # freed when this step ends
    num_steps: int = 0  # draft steps of a speculative decode step


class DraftSteps(Protocol):
    """Chooses the draft steps of a decode step by its batch, and hears what was accepted."""

    def steps_for(self, batch: int) -> int: ...

    def on_verify(self, batch: int, accepted_drafts: Sequence[int]) -> None: ...


class QueueFullError(Exception):
    """The waiting queue is at ``max_queued_requests`` (SGLang answers HTTP 503)."""


class PrefixCache:
    """Prompt prefixes seen before, LRU by tokens, matched in whole blocks."""

    # Prompts whose keys are remembered: a request's prompt is matched when it is admitted and
    # inserted when its prefill ends, and hashing a 100k-token agent prompt twice was a third of
    # a virtual agent level. Only tuples (immutable), by identity, holding them so no other
    # object takes their id; the oldest is forgotten first (a prompt held here costs 8 bytes a
    # token: 32 of 100k tokens are 26 MB). A forgotten one is hashed again: the same keys.
    MEMO_PROMPTS = 32

    def __init__(self, capacity_tokens: int) -> None:
        self._capacity_blocks = capacity_tokens // CACHE_BLOCK_TOKENS
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._memo: OrderedDict[int, tuple[Sequence[int], list[int]]] = OrderedDict()

    def keys(self, prompt: Sequence[int]) -> list[int]:
        """The prompt's whole blocks' keys, each hashing the prefix up to its block."""
        if type(prompt) is not tuple:
            return self._hash_blocks(prompt)
        memo = self._memo.get(id(prompt))
        if memo is not None and memo[0] is prompt:
            return memo[1]
        keys = self._hash_blocks(prompt)
        self._memo[id(prompt)] = (prompt, keys)
        if len(self._memo) > self.MEMO_PROMPTS:
            self._memo.popitem(last=False)
        return keys

    @staticmethod
    def _hash_blocks(prompt: Sequence[int]) -> list[int]:
        # Each key hashes the whole prefix up to its block, so a block only matches in context.
        keys, key = [], 0
        for start in range(0, len(prompt) - CACHE_BLOCK_TOKENS + 1, CACHE_BLOCK_TOKENS):
            key = hash((key, tuple(prompt[start : start + CACHE_BLOCK_TOKENS])))
            keys.append(key)
        return keys

    def match(self, prompt: Sequence[int]) -> int:
        """Number of leading prompt tokens already cached (and mark them recently used)."""
        matched = 0
        for key in self.keys(prompt):
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            matched += CACHE_BLOCK_TOKENS
        return matched

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * CACHE_BLOCK_TOKENS

    def insert(self, prompt: Sequence[int]) -> None:
        for key in self.keys(prompt):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self._capacity_blocks:
            self._blocks.popitem(last=False)


@dataclass
class EngineStats:
    """Cumulative counters, the figures /server_info, /v1/loads and /metrics report."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    spec_verify_ct: int = 0  # request-steps verified by the target model
    spec_accepted_tokens: int = 0  # tokens those steps emitted, bonus token included
    spec_accepted_drafts: int = 0
    spec_proposed_drafts: int = 0
    peak_running: int = 0
    retracted_requests: int = 0  # times a running request was put back in the queue
    reprefill_tokens: int = 0  # prompt + generated tokens computed again after a retract
    loaded_tokens: int = 0  # prompt tokens loaded from the HiCache store instead of prefilled
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    @property
    def avg_spec_accept_length(self) -> float:
        """SGLang's cumulative accepted tokens per verify (>= 1.0; 0.0 before any)."""
        return self.spec_accepted_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0

    @property
    def spec_accept_rate(self) -> float:
        """Accepted drafts / proposed drafts (SGLang 0.5.23's definition)."""
        if not self.spec_proposed_drafts:
            return 0.0
        return self.spec_accepted_drafts / self.spec_proposed_drafts

    @property
    def gen_throughput(self) -> float:
        """Tokens per second of device time over the last few decode steps."""
        seconds = sum(d for d, _ in self.recent)
        return sum(n for _, n in self.recent) / seconds if seconds else 0.0


class Engine:
    """Continuous batching for one backend; see the module docstring for the step protocol."""

    def __init__(self, profile: Profile, rng: random.Random, steps: DraftSteps | None = None) -> None:
        self.profile = profile
        self.stats = EngineStats()
        self._rng = rng
        self._cache = PrefixCache(profile.prefix_cache_tokens)
        self._waiting: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []  # admitted, prompt partly computed (holds a slot)
        self._running: list[_Seq] = []  # decoding
        self._by_rid: dict[str, _Seq] = {}
        # Who chooses the draft steps of each decode step: a chooser given, vLLM's schedule
        # (the profile's draft_schedule, gateway/sim/vllm/dynamic.py), SGLang's
        # --speculative-adaptive; else fixed.
        self._adaptive: DraftSteps | None = steps
        if steps is None and profile.draft_schedule:
            self._adaptive = ScheduledSteps(profile.draft_schedule, profile.effective_max_running,
                                            profile.num_steps)
        elif steps is None and profile.adaptive:
            self._adaptive = AdaptiveSteps(profile.num_steps, profile.effective_max_running)
        self.paused = False  # the scheduler is paused (pause_generation retract / in_place)
        # The draft model's weights came back as garbage (released without a host copy): every
        # draft is rejected, the accept length falls to 1.0 without an error (sglang #31674).
        self.drafts_broken = False
        # HiCache (gateway/sim/hicache.py), wired by the driver: called with every prompt the
        # prefix cache inserts and the tokens of it the request started from (the rest is the
        # tree's new leaf: write-through), and the share of time a prefill step pays for it.
        self.on_insert: Callable[[Sequence[int], int], None] | None = None
        self.prefill_overhead = 0.0
        self._loading = 0  # queued requests waiting for their stored prefix
        # rid -> prompt tokens the prefix cache gave it at its first admission, when kept
        # (VirtualSim(log_requests=True)): what a test compares with the prefix it expects shared
        self.cached_by_rid: dict[str, int] | None = None

    # --- state -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._running)

    @property
    def num_used_tokens(self) -> int:
        """KV tokens held by admitted requests (the prefix cache is the token pool)."""
        admitted = self._running + self._prefilling
        return sum(len(s.request.prompt) + s.generated for s in admitted)

    @property
    def kv_token_usage(self) -> float:
        return min(1.0, self.num_used_tokens / max(self.profile.prefix_cache_tokens, 1))

    @property
    def cache_hit_rate(self) -> float:
        prompt = self.stats.prompt_tokens
        return self.stats.cached_tokens / prompt if prompt else 0.0

    @property
    def prefix_cached_tokens(self) -> int:
        """Tokens held by the prefix cache (what a release would throw away)."""
        return self._cache.cached_tokens

    def device_match(self, prompt: Sequence[int]) -> int:
        """Leading prompt tokens the device's prefix cache holds."""
        return self._cache.match(prompt)

    def block_keys(self, prompt: Sequence[int]) -> list[int]:
        return self._cache.keys(prompt)

    def hold(self, rid: str) -> None:
        """The queued request waits for its stored prefix (skipped at admission,
        scheduler.py:4240-4255) until :meth:`loaded`."""
        seq = self._by_rid.get(rid)
        if seq is not None and seq in self._waiting and not seq.loading:
            seq.loading = True
            self._loading += 1

    def loaded(self, rid: str, tokens: int) -> None:
        """Its read is done: it starts from ``tokens`` of its prompt."""
        seq = self._by_rid.get(rid)
        if seq is not None and seq.loading:
            seq.loading, seq.stored = False, tokens
            self._loading -= 1

    def flush_prefix_cache(self) -> None:
        """Forget every cached prefix (a release of the KV cache flushes the radix cache)."""
        self._cache = PrefixCache(self.profile.prefix_cache_tokens)

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    @property
    def rids(self) -> list[str]:
        """Every request the engine holds, queued or admitted."""
        return list(self._by_rid)

    # --- requests in and out -----------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request. Raises QueueFullError or ValueError (duplicate rid, bad sizes)."""
        if request.rid in self._by_rid:
            raise ValueError(f"Duplicate request ID: {request.rid}")
        if request.output_len < 1 or not request.prompt:
            raise ValueError("a request needs a prompt and output_len >= 1")
        limit = self.profile.max_queued_requests
        if limit is not None and len(self._waiting) >= limit:
            raise QueueFullError("The request queue is full.")
        seq = _Seq(request, self._accept_prob(request))
        self._waiting.append(seq)
        self._by_rid[request.rid] = seq

    def abort(self, rid: str = "", abort_all: bool = False, *, exact: bool = False) -> list[str]:
        """Free matching requests at once: by rid prefix, as SGLang's scheduler does for
        /abort_request, or (`exact`) the one request the simulator itself ends."""
        if exact:
            aborted = [rid] if rid in self._by_rid else []
        else:
            aborted = [r for r in self._by_rid if abort_all or (rid and r.startswith(rid))]
        for r in aborted:
            self._remove(self._by_rid[r])
        return aborted

    def abort_after_next_step(self, rid: str) -> bool:
        """Client gone: a queued request leaves now (returns True), a running one is freed
        at the end of the next step (its finish_step output says "abort")."""
        seq = self._by_rid.get(rid)
        if seq is None:
            return False
        if seq in self._waiting:
            self._remove(seq)
            return True
        seq.abort_at_step_end = True
        return False

    def _remove(self, seq: _Seq) -> None:
        seq.gone = True
        if seq.loading:
            seq.loading = False
            self._loading -= 1
        del self._by_rid[seq.request.rid]
        for pool in (self._waiting, self._prefilling, self._running):
            if seq in pool:
                pool.remove(seq)

    def _accept_prob(self, request: Request) -> float:
        repetitive = request.greedy and len(set(request.prompt[:256])) == 1
        return self.profile.accept_prob_repetitive if repetitive else self.profile.accept_prob

    # --- steps -------------------------------------------------------------------------

    def begin_step(self) -> Step | None:
        """Plan the next step, or None when there is nothing to do (or the engine is paused)."""
        if self.paused:
            return None
        aborting = [s for s in self._prefilling + self._running if s.abort_at_step_end]
        step = self._plan_prefill() or self._plan_decode()
        if step is not None:
            step.aborting = aborting
        return step

    def _plan_prefill(self) -> Step | None:
        budget = self.profile.chunked_prefill_size
        seqs, tokens = [], []
        for seq in self._prefilling:  # a chunked prompt continues before anything new
            if budget <= 0:
                break
            take = min(seq.uncached, budget)
            seqs.append(seq)
            tokens.append(take)
            budget -= take
        while budget > 0 and self._waiting and self.num_running < self.profile.effective_max_running:
            admitted = self._next_admissible()
            if admitted is None:
                break
            self._admit(admitted)
            take = min(admitted.uncached, budget)
            seqs.append(admitted)
            tokens.append(take)
            budget -= take
        if not seqs:
            return None
        duration = self.profile.prefill_step_s(sum(tokens)) * (1.0 + self.prefill_overhead)
        return Step("prefill", duration, seqs, tokens)

    def _next_admissible(self) -> _Seq | None:
        """The first queued request not waiting for a load, taken out of the queue."""
        if not self._loading:
            return self._waiting.popleft()
        for i, seq in enumerate(self._waiting):
            if not seq.loading:
                del self._waiting[i]
                return seq
        return None

    def _admit(self, seq: _Seq) -> None:
        prompt = seq.request.prompt
        if seq.retracted:
            # Prompt + generated tokens from scratch, less what the prefix cache still has of the
            # prompt: the retract frees the request's KV without inserting it in the radix tree
            # (managers/schedule_batch.py:2388-2389).
            total = len(prompt) + seq.generated
            seq.reused = min(self._cache.match(prompt), total - 1)
            seq.uncached = total - seq.reused
            self.stats.reprefill_tokens += seq.uncached
            self._prefilling.append(seq)
            return
        device = self._cache.match(prompt)
        # the last token is always computed
        cached = min(max(device, seq.stored), len(prompt) - 1)
        self.stats.loaded_tokens += max(0, cached - device)
        seq.uncached = len(prompt) - cached
        seq.reused = cached
        self.stats.prompt_tokens += len(prompt)
        self.stats.cached_tokens += cached
        if self.cached_by_rid is not None:
            self.cached_by_rid[seq.request.rid] = cached
        self._prefilling.append(seq)

    # --- the memory saver's operations -------------------------------------------------

    def retract(self) -> list[str]:
        """``pause_generation`` in retract mode (scheduler.py:5848-5919): every admitted request
        (decoding, or part way through its prefill) goes back to the end of the waiting queue
        and frees its KV; it keeps what it generated, and is prefilled again, prompt and
        generated tokens, when admitted next. Returns their rids, in queue order."""
        retracted = self._running + self._prefilling
        for seq in retracted:
            seq.retracted = True
            seq.uncached = 0
        self._running, self._prefilling = [], []
        self._waiting.extend(retracted)
        self.stats.retracted_requests += len(retracted)
        return [seq.request.rid for seq in retracted]

    def flush_cache(self) -> None:
        """Empty the prefix cache (a release of the KV cache flushes the radix tree)."""
        self._cache = PrefixCache(self.profile.prefix_cache_tokens)

    @property
    def is_fully_idle(self) -> bool:
        """Nothing admitted, nothing queued (scheduler.py:5337 is_fully_idle)."""
        return not self.has_work

    @property
    def only_queued(self) -> bool:
        """Nothing admitted (queued requests hold no KV): is_fully_idle(ignore_waiting=True)."""
        return not (self._running or self._prefilling)

    def _plan_decode(self) -> Step | None:
        if not self._running:
            return None
        batch = list(self._running)
        if self._adaptive is not None:
            steps = self._adaptive.steps_for(len(batch))
            return Step("decode", self.profile.spec_step_s(len(batch), steps), batch, num_steps=steps)
        return Step("decode", self.profile.decode_step_s(len(batch)), batch,
                    num_steps=self.profile.num_steps if self.profile.speculative else 0)

    def finish_step(self, step: Step) -> list[Output]:
        """Apply a finished step; returns what each request got (in batch order)."""
        if step.kind == "prefill":
            outputs = self._finish_prefill(step)
        else:
            outputs = self._finish_decode(step)
        for seq in step.aborting:
            if not seq.gone:
                self._remove(seq)
                outputs.append(Output(seq.request.rid, 0, finish_reason="abort"))
        self.stats.peak_running = max(self.stats.peak_running, self.num_running)
        return outputs

    def _finish_prefill(self, step: Step) -> list[Output]:
        outputs = []
        for seq, take in zip(step.seqs, step.prefill_tokens, strict=True):
            if seq.gone:
                continue
            seq.uncached -= take
            if seq.uncached > 0:
                continue
            # Prefill done: the forward pass that completes the prompt samples the first token.
            self._cache.insert(seq.request.prompt)
            if self.on_insert is not None:
                self.on_insert(seq.request.prompt, seq.reused)
            self._prefilling.remove(seq)
            self._running.append(seq)
            # A retracted request's prefill samples its next token, not its first.
            outputs.append(self._emit(seq, 1, first=not seq.retracted))
        return outputs

    def _finish_decode(self, step: Step) -> list[Output]:
        # Every virtual bench's hot loop (each running request, each step): the counters are
        # summed here and added once per step, the same totals as added per request.
        outputs: list[Output] = []
        accepted_drafts: list[int] = []
        emitted = verified = accepted_total = 0
        speculative, steps = self.profile.speculative, step.num_steps
        adaptive = self._adaptive is not None  # the only reader of accepted_drafts
        new_output = tuple.__new__  # Output(...) without the named tuple's Python-level __new__
        for seq in step.seqs:
            if seq.gone:
                continue
            if speculative:
                accepted = self._accepted(seq.accept_prob, steps)
                verified += 1
                accepted_total += accepted
            else:
                accepted = 0
            if adaptive:
                accepted_drafts.append(accepted)
            request = seq.request
            left = request.output_len - seq.generated
            if accepted < left - 1:
                n = accepted + 1
                outputs.append(new_output(Output, (request.rid, n, False, None)))
            else:  # its last tokens
                n = left
                self._remove(seq)
                outputs.append(Output(request.rid, n, False, "length"))
            emitted += n
            seq.generated += n
        stats = self.stats
        stats.generated_tokens += emitted
        if verified:
            stats.spec_verify_ct += verified
            stats.spec_accepted_drafts += accepted_total
            stats.spec_proposed_drafts += verified * steps
            stats.spec_accepted_tokens += accepted_total + verified
        stats.recent.append((step.duration_s, emitted))
        if self._adaptive is not None:
            self._adaptive.on_verify(len(step.seqs), accepted_drafts)
        return outputs

    def _accepted(self, accept_prob: float, steps: int) -> int:
        """Drafts accepted until the first rejection (the target model adds its bonus token)."""
        if self.drafts_broken:
            return 0
        accepted, draw = 0, self._rng.random
        while accepted < steps and draw() < accept_prob:
            accepted += 1
        return accepted

    def _emit(self, seq: _Seq, n: int, first: bool = False) -> Output:
        seq.generated += n
        self.stats.generated_tokens += n
        if seq.generated < seq.request.output_len:
            return Output(seq.request.rid, n, first)
        self._remove(seq)
        return Output(seq.request.rid, n, first, finish_reason="length")
