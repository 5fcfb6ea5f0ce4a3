"""Typed, validated, frozen settings: config.yaml plus GATEWAY_* environment overrides.

`load_settings(path)` is the only reader of the file and the environment; everything else
receives a `Settings`. Errors come out as one `ConfigError` naming the offending key.

One module of ~320 lines on purpose: it is the schema of config.yaml, one class per section in
the file's order, read top to bottom beside it; the loader is the last 40 lines.
"""

from __future__ import annotations

import fnmatch
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token
_GLOB = re.compile(r"[*?\[]")  # what makes a model alias a pattern (fnmatch's syntax)

Role = Literal["mtp", "plain"]  # a server's role in its pair
ROLES: tuple[Role, ...] = ("mtp", "plain")
PolicyName = Literal["crossover", "mtp-only", "plain-only"]
# split: each server keeps its share of the GPUs' memory; turns: the two take turns owning
# all of it (SGLang's memory saver, gateway/turns, docs/architecture.md "A turn's path").
MemoryShape = Literal["split", "turns"]
# What the configuration asks: a shape, or auto: turns where both servers report the memory
# saver in /server_info, split otherwise (gateway/turns/shape.py).
MemorySetting = Literal["auto", "split", "turns"]
# What a pair's two servers are (gateway/upstream/engine/: one module each): SGLang 0.5.23 or
# vLLM 0.33.0. The pair's own `engine`, else the top-level one (`Settings.engine_of`).
EngineName = Literal["sglang", "vllm"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Listen(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class Backend(_Frozen):
    url: str
    api_key: str | None = None
    admin_api_key: str | None = None  # SGLang --admin-api-key: /abort_request needs it when set

    @model_validator(mode="after")
    def _url_is_http(self) -> Backend:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend url must start with http:// or https://, got {self.url!r}")
        for key in (self.api_key, self.admin_api_key):
            if key is not None and not (key.isascii() and key.isprintable()):
                raise ValueError("backend keys must be printable ASCII (they go in a header)")
        return self


class Backends(_Frozen):
    mtp: Backend = Backend(url="http://127.0.0.1:30001")
    plain: Backend = Backend(url="http://127.0.0.1:30002")

    def get(self, role: Role) -> Backend:
        return self.mtp if role == "mtp" else self.plain


class Routing(_Frozen):
    policy: PolicyName = "crossover"
    crossover: int = Field(31, ge=1)
    adapt_to_accept_length: bool = True
    reference_accept_length: float = Field(2.0, ge=1.0)
    adaptive_crossover: bool = True
    crossover_bounds: tuple[int, int] = (16, 256)
    hysteresis: int = Field(6, ge=0)
    min_dwell_s: float = Field(5.0, ge=0)
    capacity_guard: bool = False
    move_unstarted: bool = True
    handoff_running: bool = False
    session_affinity: bool = False
    session_headers: tuple[str, ...] = ("x-session-id", "x-claude-code-session-id", "thread-id")
    max_sessions: int = Field(10000, ge=0)
    allow_pin_header: bool = False
    # Several pairs: a session stays on the pair holding its prefix while that pair has at
    # most this many requests more than the least loaded one.
    pair_affinity_slack: int = Field(8, ge=0)
    # Prompt tokens a server prefills a second: what a re-sent prefix costs (gateway/turns).
    prefill_tokens_per_s: float = Field(16000.0, gt=0)
    load_signal: Literal["requests", "sessions"] = "sessions"
    session_idle_s: float = Field(6.0, ge=0)  # sessions: a session this long idle is gone
    session_crossover: int = Field(22, ge=1)  # sessions: the crossover in sessions at work

    @model_validator(mode="after")
    def _band_fits(self) -> Routing:
        if self.hysteresis >= self.crossover:
            raise ValueError("hysteresis must be smaller than crossover")
        low, high = self.crossover_bounds
        if not self.hysteresis < low <= high:
            raise ValueError("crossover_bounds must be [low, high] with hysteresis < low <= high")
        return self

    @field_validator("session_headers")
    @classmethod
    def _header_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        # A name no request can carry ("", "é", "a b") made every proxied request fail (500).
        bad = [name for name in names if not _HEADER_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"not HTTP header names: {bad}")
        return names


# What a pair may set for itself: the MTP/plain trade-off belongs to one set of GPUs.
PAIR_ROUTING_KEYS = frozenset({
    "policy", "crossover", "adapt_to_accept_length", "reference_accept_length",
    "adaptive_crossover", "crossover_bounds", "hysteresis", "min_dwell_s", "capacity_guard",
    "move_unstarted", "handoff_running", "session_affinity"})
_PAIR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")  # a metric label and a URL-safe name


class Pair(_Frozen):
    """An MTP server and a plain server on the same GPUs."""

    name: str
    mtp: Backend
    plain: Backend
    routing: dict[str, Any] = Field(default_factory=dict)  # this pair's own routing values
    memory: MemorySetting | None = None  # None: the top-level `memory`
    engine: EngineName | None = None  # None: the top-level `engine`
    controller_url: str | None = None  # turns: the gateway driving it (None: turns.controller_url)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _PAIR_NAME.fullmatch(name):
            raise ValueError("a pair name is 1-32 letters, digits, '_', '.', '-'")
        return name

    @field_validator("routing")
    @classmethod
    def _own_keys(cls, routing: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(routing) - PAIR_ROUTING_KEYS)
        if unknown:
            raise ValueError(f"not settable per pair: {unknown} (per pair: "
                             f"{', '.join(sorted(PAIR_ROUTING_KEYS))})")
        return routing


def _unclosed_bracket(pattern: str) -> bool:
    """A `[` that fnmatch would read as itself, not as a set: a typo in a pattern. Scanned as
    fnmatch.translate scans it (a `]` right after `[` or `[!` belongs to the set)."""
    start = pattern.find("[")
    while start >= 0:
        end = start + 1
        end += pattern.startswith("!", end)
        end += pattern.startswith("]", end)
        close = pattern.find("]", end)
        if close < 0:
            return True
        start = pattern.find("[", close + 1)
    return False


class Models(_Frozen):
    """Model aliases: a name a client sends, or a shell-style pattern of names (`*`, `?`,
    `[...]`, matched case-sensitively), mapped to the name the servers serve. Exact names first,
    then the patterns in the order written; the first that matches wins. The request's
    `model` is rewritten before it goes upstream (gateway/relay/inbound.py `with_model`)."""

    aliases: dict[str, str] = Field(default_factory=dict)
    list_aliases: bool = False  # GET /v1/models lists each exact alias beside the served name

    @field_validator("aliases")
    @classmethod
    def _names_and_patterns(cls, aliases: dict[str, str]) -> dict[str, str]:
        for name, served in aliases.items():
            if not name.strip():
                raise ValueError("an alias must not be empty")
            if _unclosed_bracket(name):
                raise ValueError(f"alias {name!r}: a '[' in a pattern must be closed by ']'")
            if not served.strip():
                raise ValueError(f"alias {name!r} maps to an empty model name")
            if _GLOB.search(served):
                raise ValueError(f"alias {name!r} maps to {served!r}: the served model is a "
                                 "name, not a pattern")
        return aliases

    @cached_property
    def _patterns(self) -> tuple[tuple[re.Pattern[str], str], ...]:
        return tuple((re.compile(fnmatch.translate(name)), served)
                     for name, served in self.aliases.items() if _GLOB.search(name))

    def served_name(self, model: str) -> str | None:
        """The served name a client's `model` stands for; None when no alias matches."""
        served = self.aliases.get(model)
        if served is not None:
            return served
        for pattern, served in self._patterns:
            if pattern.match(model):
                return served
        return None

    def exact_aliases(self) -> dict[str, str]:
        """The aliases that are names, not patterns: what /v1/models lists."""
        return {name: served for name, served in self.aliases.items() if not _GLOB.search(name)}


class Handoff(_Frozen):
    """Continuing a running stream on another server (gateway.relay.continuing), per use."""

    on_failure: bool = True  # its server failed it after the first byte (once per stream)
    at_turn: bool = True  # a pair's turn hands the memory over (InFlight.continue_running)
    # A stream is continued only while every event it sent is kept: up to this many pieces
    # (~230 bytes a token each). Beyond it: not continued, and all but the last few let go of.
    transcript_chunks: int = Field(8192, ge=1)


class Timeouts(_Frozen):
    connect_s: float = Field(5.0, gt=0)
    first_byte_s: float = Field(600.0, gt=0)
    idle_s: float = Field(120.0, gt=0)
    total_s: float = Field(3600.0, gt=0)
    keepalive_s: float = Field(15.0, ge=0)
    shutdown_grace_s: float = Field(30.0, ge=0)


class Limits(_Frozen):
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    max_inflight: int = Field(1024, ge=1)
    max_header_bytes: int = Field(64 * 1024, ge=1024)


class Auth(_Frozen):
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    metrics_public: bool = True


class Monitor(_Frozen):
    interval_s: float = Field(1.0, gt=0)
    request_timeout_s: float = Field(2.0, gt=0)
    fall: int = Field(3, ge=1)
    rise: int = Field(2, ge=1)
    circuit_failures: int = Field(5, ge=1)
    circuit_open_s: float = Field(10.0, gt=0)
    use_backend_loads: bool = False
    backend_loads_max_age_s: float = Field(3.0, gt=0)


class Turns(_Frozen):
    """How a turns pair hands its memory over (gateway/turns): the bounds and the checks."""

    wait_max_requests: int = Field(256, ge=0)  # arrivals that may wait at the gateway for a turn
    wait_max_s: float = Field(10.0, gt=0)  # ... each at most this long; then a 503
    retry_after_s: int = Field(2, ge=1)  # that 503's Retry-After
    # While the holder, up, has its circuit open (or its half-open trial out), arrivals wait
    # for the circuit at most this long (it opens for monitor.circuit_open_s, then its trial
    # must end well); then the 503 no_backend_available a pair with no server admitting gets.
    wait_circuit_max_s: float = Field(30.0, gt=0)
    finish_within_s: float = Field(30.0, ge=0)  # running streams finish first within this
    # Before its pause, the outgoing server's prefix-cache writes to its store (HiCache) settle:
    # its backup counters unchanged for caches_quiet_s, within keep_caches_within_s (past it the
    # turn goes on and what is not written is lost). A server without HiCache passes at once.
    keep_caches_within_s: float = Field(10.0, ge=0)
    caches_quiet_s: float = Field(0.3, gt=0)
    call_timeout_s: float = Field(10.0, gt=0)  # pause, continue and every probe
    release_timeout_s: float = Field(60.0, gt=0)  # SGLang answers once every rank has released
    resume_timeout_s: float = Field(60.0, gt=0)
    ready_within_s: float = Field(30.0, gt=0)  # /ready 200 after continue_generation
    check_memory: bool = True  # NVML, where the GPUs are visible: the memory really came back
    min_free_fraction: float = Field(0.5, gt=0, le=1)  # ... this much of each GPU free
    min_accept_length: float = Field(1.2, ge=0)  # after a resume into MTP (0: no check)
    stuck_retry_s: float = Field(5.0, gt=0)  # a stuck pair is discovered again this often
    # When to hand over (gateway/turns/decision.py), with the routing's crossover, hysteresis
    # and min_dwell_s: a turn's cost until one is measured, the dwell in turns' costs, how
    # long the load must stand on the other side first, and what the holder must have forgone
    # there first: payback_turns times what the sessions at work pay for their contexts on the
    # incoming server, at gain_per_crossover of the machine's output for each crossover's
    # worth of distance past the crossover (0: turn at once).
    turn_cost_s: float = Field(1.5, ge=0)
    dwell_turns: float = Field(10.0, ge=0)
    to_plain_after_s: float = Field(0.0, ge=0)
    to_mtp_after_s: float = Field(5.0, ge=0)
    payback_turns: float = Field(1.0, ge=0)
    gain_per_crossover: float = Field(0.5, gt=0)
    # Each server keeps its prefix cache in its own HiCache L3 store (SGLang's
    # --enable-hierarchical-cache, write_through, an L3 namespace each: docs/turns.md): a turn
    # then costs the sessions at work what the incoming server's store lacks, prefilled, and
    # the rest loaded at store_load_tokens_per_s (12,288 B a token a rank read from a tmpfs at
    # ~3 GB/s, then copied at ~51 GB/s: ~230k tokens/s).
    kv_store: bool = False
    store_load_tokens_per_s: float = Field(230_000.0, gt=0)
    state_file: str | None = None  # the journal a restart settles from (one per node)
    # Several replicas: the gateway beside the pair drives its turns (null: this one does);
    # the others follow its GET /turns/state and hand off their own streams at a turn.
    controller_url: str | None = None


class Log(_Frozen):
    access: bool = True  # one line per request on the logger mtp_gateway.access


class ConfigError(Exception):
    """Invalid configuration; the message names the key."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        frozen=True, extra="forbid", env_prefix="GATEWAY_", env_nested_delimiter="__"
    )

    listen: Listen = Listen()
    backends: Backends = Backends()  # one pair; or `pairs`
    pairs: tuple[Pair, ...] = ()
    routing: Routing = Routing()
    models: Models = Models()
    timeouts: Timeouts = Timeouts()
    handoff: Handoff = Handoff()
    limits: Limits = Limits()
    auth: Auth = Auth()
    monitor: Monitor = Monitor()
    log: Log = Log()
    memory: MemorySetting = "auto"  # every pair's, unless the pair says
    engine: EngineName = "sglang"  # every pair's, unless the pair says
    turns: Turns = Turns()

    @model_validator(mode="after")
    def _pairs_fit(self) -> Settings:
        if self.pairs and "backends" in self.model_fields_set:
            raise ValueError("give `backends` (one pair) or `pairs`, not both")
        names = [p.name for p in self.pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"pair names must differ: {names}")
        for pair in self.pairs:
            try:
                self.routing_for(pair)
            except ValidationError as exc:
                where = f"pairs.{pair.name}.routing"
                raise ValueError(describe_validation_error(exc, prefix=where)
                                 .removeprefix("invalid configuration: ")) from exc
        return self

    def fleet(self) -> tuple[Pair, ...]:
        """The pairs to route over: `pairs`, or the one pair of `backends`."""
        return self.pairs or (Pair(name="default", mtp=self.backends.mtp,
                                   plain=self.backends.plain),)

    def memory_of(self, pair: Pair) -> MemorySetting:
        return pair.memory or self.memory

    def engine_of(self, pair: Pair) -> EngineName:
        """What the pair's servers are: the one place the engine is chosen."""
        return pair.engine or self.engine

    def controller_of(self, pair: Pair) -> str | None:
        """A turns pair's controller when another gateway drives it (None: this one)."""
        return pair.controller_url or self.turns.controller_url

    def routing_for(self, pair: Pair) -> Routing:
        """A pair's routing: the routing section with the pair's own values over it."""
        if not pair.routing:
            return self.routing
        return Routing.model_validate({**self.routing.model_dump(), **pair.routing})

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first so GATEWAY_* beats the file (the file arrives as init kwargs).
        return (env_settings, init_settings)


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def build_settings(data: dict[str, Any]) -> Settings:
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from exc


def load_settings(path: str | Path | None = None) -> Settings:
    return build_settings(read_yaml(path) if path else {})


def build_routing(data: Any) -> Routing:
    """Validate a routing section alone (hot reload, PUT /admin/routing)."""
    try:
        return Routing.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, prefix="routing")) from exc


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        key = f"{prefix}.{key}" if prefix and key else (prefix or key or "(top level)")
        lines.append(f"{key}: {err['msg']}")
    return "invalid configuration: " + "; ".join(lines)
