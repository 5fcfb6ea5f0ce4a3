"""Where a simulated server's capacities come from: GPU memory, weights, and SGLang's sizing.

One module of ~600 lines on purpose: SGLang's sizing, quoted line by line, and the deploy
sizing tables computed from it (`python -m gateway.sim.memory`), which must not drift apart.

SGLang 0.5.23 sizes one server like this (file:line under sglang/srt/ in the 0.5.23 wheel):

1. Just before loading weights it measures the **free** GPU memory ``F`` (per GPU;
   ``distributed/bootstrap.py:193`` ``measure_pre_model_load_memory``).
2. After loading the weights (the draft model's too), the pools get
   ``rest = free_after_weights - F * (1 - mem_fraction_static)``
   (``mem_cache/kv_cache_configurator.py:2990`` ``_profile_available_bytes``), i.e. the
   static footprint (weights + pools) is ``mem_fraction_static * F``. A second server started
   after the first sees only what the first left: its fraction applies to that.
3. Hybrid models split ``rest`` between Mamba (linear-attention) states and the KV cache with
   ``--mamba-full-memory-ratio`` (0.9): Mamba budget = ``rest * 0.9 / 1.9``
   (``kv_cache_configurator.py:3350`` ``_handle_max_mamba_cache``). Slots:
   ``K = (budget - per_req) // per_req`` without speculation; with it the per-draft-token
   intermediate states are solved jointly:
   ``K = (budget - per_req * (1 + D)) // (per_req * (1 + D / ratio))`` and
   ``per_req * (min(max_running, K // ratio) + 1) * D`` is reserved (D = draft tokens).
   The KV pool gets what remains after ``(K + 1) * per_req`` and that reservation.
4. Running cap (``kv_cache_configurator.py:3119`` ``resolve_max_num_reqs``):
   ``min(max_running_requests or clamp(tokens / context_len * 512, 2048, 4096), tokens // 2,
   K // ratio)`` with ``ratio = 3 + 2`` for ``extra_buffer`` with the overlap scheduler
   (``_calculate_mamba_ratio`` L3062, ``allocation_sizing.py:11``). Speculation sets
   ``max_running_requests = 48`` when it is not given (``arg_groups/speculative_hook.py``
   ``_handle_eagle_family``).

The model below is Qwen3.5-122B-A10B. Everything here is derived, not measured: the
assumptions (overheads, weight sizes) are named constants with their reasoning, and
``docker/README.md``'s sizing table is generated from this module (``python -m
gateway.sim.memory``; a test keeps the two equal).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Only for annotations: gateway.sim.profile imports this module at run time.
    from gateway.sim.profile import Profile

GIB = float(1 << 30)
GB = 1e9


@dataclass(frozen=True)
class ModelConfig:
    """The shapes that size the pools. Defaults: Qwen3.5-122B-A10B.

    Source: the model's config.json (text_config) as public copies give it: 48 layers, every
    4th full attention (12 full, 36 Gated DeltaNet), 32 query / 2 KV heads of dim 256, linear
    attention with 16 key / 64 value heads of dim 128 and a conv kernel of 4,
    mamba_ssm_dtype float32, 256 experts (8 active) of moe_intermediate_size 1024, hidden 3072,
    vocab 248,320, one MTP layer (mtp_num_hidden_layers 1). SGLang reads these in
    ``configs/qwen3_next.py`` (layers_block_type, mamba2_cache_params) and sizes a state in
    ``configs/mamba_utils.py:116`` (mamba_cache_per_req) / ``Mamba2StateShape.create``.
    """

    name: str = "Qwen3.5-122B-A10B"
    num_layers: int = 48
    full_attention_interval: int = 4
    num_kv_heads: int = 2
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 64
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    ssm_state_bytes: int = 4  # mamba_ssm_dtype float32 (config); SGLang's default too
    conv_state_bytes: int = 2  # conv states bfloat16 (SGLANG_MAMBA_CONV_DTYPE default)
    kv_bytes: int = 2  # kv_cache_dtype auto -> bfloat16
    draft_layers: int = 1  # the MTP head: one full-attention decoder layer
    context_len: int = 262_144
    # Parameters, for weight bytes. Total 122e9 (the name). Kept in 16 bits by the FP8
    # checkpoint: embeddings + lm_head (2 x 248,320 x 3072 = 1.53e9), the vision tower (~0.4e9)
    # and the small GDN / norm / router tensors (~0.5e9, estimated).
    params: float = 122e9
    params_unquantized_in_fp8: float = 2.43e9
    # The MTP layer: attention (~0.08e9) + 256 experts x 3 x 3072 x 1024 (2.42e9) + fc/norms;
    # it shares the target's embeddings and lm_head (models/qwen3_5_mtp.py set_embed_and_head).
    draft_params: float = 2.52e9
    # RoPE: partial_rotary_factor 0.25 of head_dim 256. Its cos/sin cache (context_len x
    # rotary_dim, float32 at most) is the model's one sizeable named buffer, which a release
    # clones on the GPU (see NAMED_BUFFER_CLONE below).
    rotary_dim: int = 64

    @property
    def full_attention_layers(self) -> int:
        return self.num_layers // self.full_attention_interval

    @property
    def linear_layers(self) -> int:
        return self.num_layers - self.full_attention_layers

    def weight_bytes(self, precision: str) -> float:
        """Whole-model weight bytes (all GPUs) for ``bf16`` or ``fp8``."""
        if precision == "bf16":
            return self.params * 2
        if precision == "fp8":
            return (self.params - self.params_unquantized_in_fp8) + 2 * self.params_unquantized_in_fp8
        raise ValueError(f"unknown weight precision {precision!r} (bf16 or fp8)")

    def draft_weight_bytes(self, precision: str) -> float:
        return self.draft_params * (2 if precision == "bf16" else 1)

    def mamba_bytes_per_request(self, tp: int) -> int:
        """One request's linear-attention state on one GPU (``mamba_cache_per_req``)."""
        groups = self.linear_num_key_heads
        if groups % tp:
            groups += tp - groups  # extra_groups_for_head_shards
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        conv_dim = value_dim + 2 * groups * self.linear_key_head_dim
        conv = conv_dim // tp * (self.linear_conv_kernel - 1) * self.conv_state_bytes
        ssm = (self.linear_num_value_heads // tp) * self.linear_value_head_dim * self.linear_key_head_dim
        return (conv + ssm * self.ssm_state_bytes) * self.linear_layers

    def named_buffer_bytes(self) -> int:
        """The model's named buffers on one GPU: the RoPE cos/sin cache, replicated per rank."""
        return self.context_len * self.rotary_dim * 4

    def kv_bytes_per_token(self, tp: int, draft: bool) -> int:
        """K and V of one token on one GPU; KV heads are replicated when tp > heads."""
        heads = max(1, self.num_kv_heads // tp)
        layers = self.full_attention_layers + (self.draft_layers if draft else 0)
        return layers * 2 * heads * self.head_dim * self.kv_bytes


QWEN35_122B = ModelConfig()


# --- what a server holds outside its static pool, per GPU (GiB) --------------------------------
# Held before the server measures its free memory (parallel init comes first,
# distributed/bootstrap.py:193-213), so never part of F, and kept while it is released:
# - its CUDA context: the driver's per-process state on each GPU, ~0.5 GiB with lazy module
#   loading on Hopper/Blackwell (an estimate; nvidia-smi shows it per process);
CUDA_CONTEXT_GIB = 0.5
# - NCCL communicators (TP, world and PP groups, their per-peer channel buffers) and the custom
#   all-reduce: ~0.5 GiB together at TP 4 (an estimate), of which the custom all-reduce's own is
#   3 x 8 MiB per GPU (device_communicators/custom_all_reduce.py:42 _MAX_CAR_SIZE; meta, IPC and
#   rank_data buffers L106-119), cudaMalloc'd outside any memory-saver region.
CUSTOM_ALL_REDUCE_GIB = 3 * 8 * (1 << 20) / GIB
NCCL_AND_ALL_REDUCE_GIB = 0.5
START_OVERHEAD_GIB = CUDA_CONTEXT_GIB + NCCL_AND_ALL_REDUCE_GIB
# Taken after the static pool, while the server captures graphs and runs (estimates; measure
# with nvidia-smi on real GPUs):
# - CUDA graphs: the decode graphs' shared pool (and the MTP draft/verify graphs). Released with
#   the tag "cuda_graph" only when the server started with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1
#   (runner_backend/full_cuda_graph_backend.py:121-124), backed up on the host then (L185-193);
#   otherwise they stay on the GPU. That variable needs a prefill graph backend other than
#   "breakable", the CUDA default, which refuses it at start
#   (runner_backend/breakable_cuda_graph_backend.py:84-94): --cuda-graph-backend-prefill disabled;
CUDA_GRAPHS_GIB = 2.0
# - attention backend workspaces, logits and sampling buffers, graph input buffers: plain tensors
#   allocated at start outside any memory-saver region, so a release keeps them;
ATTENTION_AND_LOGITS_BUFFERS_GIB = 0.5
# - activations: the PyTorch caching allocator's blocks of the forward passes (the chunked
#   prefill's peak). A release gives them back: releasing "kv_cache" flushes the cache
#   (managers/scheduler_components/weight_updater.py:365-366) with empty_cache
#   (managers/scheduler.py:5518, 5533-5534).
ACTIVATIONS_GIB = 2.5
RUNTIME_OVERHEAD_GIB = CUDA_GRAPHS_GIB + ATTENTION_AND_LOGITS_BUFFERS_GIB + ACTIVATIONS_GIB


@dataclass(frozen=True)
class Hardware:
    """One node: ``gpus`` GPUs of ``gpu_gib`` as CUDA reports them, tensor parallel over all."""

    name: str
    label: str
    gpus: int
    gpu_gib: float
    # Used before a server measures its free memory (SGLang measures after parallel init,
    # bootstrap.py:193-213): its CUDA context and communicators, see START_OVERHEAD_GIB.
    start_overhead_gib: float = START_OVERHEAD_GIB
    # What a started server holds beyond its static pool: CUDA graphs, activations, attention
    # and logits buffers, see RUNTIME_OVERHEAD_GIB. The second server of a split pair sees the
    # free memory after it.
    runtime_overhead_gib: float = RUNTIME_OVERHEAD_GIB
    # The compose split recommended for this hardware: (MEM_FRACTION_MTP, MEM_FRACTION_PLAIN).
    pair_fractions: tuple[float, float] = (0.45, 0.85)
    # The turns shape (docker/compose.turns.yaml): (MEM_FRACTION_MTP, MEM_FRACTION_PLAIN), each
    # server sized for the whole GPU less the parked one's leftovers; see size_turns.
    turns_fractions: tuple[float, float] = (0.75, 0.873)

    @property
    def free_at_start_gib(self) -> float:
        return self.gpu_gib - self.start_overhead_gib


# nvidia-smi totals: RTX PRO 6000 Blackwell 97,887 MiB; H200 143,771 MiB.
HARDWARE = {
    "rtx-pro-6000": Hardware("rtx-pro-6000", "4x RTX PRO 6000 Blackwell (96 GB)", 4, 97_887 / 1024),
    "h200": Hardware("h200", "4x H200 (141 GB)", 4, 143_771 / 1024, pair_fractions=(0.40, 0.85)),
}
DEFAULT_HARDWARE = "rtx-pro-6000"

SPECULATIVE_DEFAULT_MAX_RUNNING = 48  # speculative_hook.py _handle_eagle_family
MAMBA_FULL_MEMORY_RATIO = 0.9  # --mamba-full-memory-ratio default
# extra_buffer with the overlap scheduler: 3 base + 2 ping-pong tracking slots per request.
MAMBA_SLOTS_PER_REQUEST = 5


@dataclass(frozen=True)
class Launch:
    """The flags of one SGLang server that change its memory."""

    mem_fraction_static: float
    speculative: bool = False
    num_draft_tokens: int = 0  # D: speculative_num_steps + 1 with topk 1
    max_running_requests: int | None = None
    weights: str = "fp8"
    mamba_full_memory_ratio: float = MAMBA_FULL_MEMORY_RATIO  # --mamba-full-memory-ratio


@dataclass(frozen=True)
class Sizing:
    """One server's memory on one GPU (GiB) and the capacities SGLang derives from it."""

    free_gib: float  # free when it started (F)
    static_gib: float  # mem_fraction_static * F
    weights_gib: float  # target (+ draft) weights
    pool_gib: float  # static - weights: Mamba states + spec states + KV cache
    mamba_slots: int  # max_mamba_cache_size
    mamba_gib: float
    spec_state_gib: float  # intermediate SSM states for draft tokens (speculation only)
    kv_gib: float
    kv_tokens: int  # max_total_num_tokens: the KV pool, which is also the prefix cache
    max_running: int  # effective max_running_requests (what /server_info reports per dp)
    resolved_max_running: int  # the max_running_requests argument after SGLang's defaults


def size_server(launch: Launch, free_gib: float, hardware: Hardware,
                model: ModelConfig = QWEN35_122B) -> Sizing:
    """SGLang 0.5.23's sizing of one server that starts with ``free_gib`` free per GPU."""
    tp = hardware.gpus
    weights = model.weight_bytes(launch.weights) / tp / GIB
    if launch.speculative:
        weights += model.draft_weight_bytes(launch.weights) / tp / GIB
    static = launch.mem_fraction_static * free_gib
    pool = static - weights
    if pool <= 0:
        raise ValueError(f"Loaded weights leave no GPU memory for the KV cache under "
                         f"--mem-fraction-static={launch.mem_fraction_static} "
                         f"({weights:.1f} GiB of weights per GPU, {static:.1f} GiB static)")
    per_req = model.mamba_bytes_per_request(tp)
    mamba_ratio = launch.mamba_full_memory_ratio
    budget = pool * GIB * mamba_ratio / (1 + mamba_ratio)
    ratio = MAMBA_SLOTS_PER_REQUEST
    resolved = launch.max_running_requests
    if resolved is None and launch.speculative:
        resolved = SPECULATIVE_DEFAULT_MAX_RUNNING
    spec_state = 0.0
    if launch.speculative:
        d = launch.num_draft_tokens
        slots = int((budget - per_req * (1 + d)) // (per_req * (1 + d / ratio)))
        assert resolved is not None
        capped = min(resolved, slots // ratio)
        spec_state = per_req * (capped + 1) * d
    else:
        slots = int((budget - per_req) // per_req)
    if slots <= 0:
        raise ValueError("Not enough GPU memory for hybrid (mamba/linear-attention) state cache")
    mamba = (slots + 1) * per_req
    kv = pool * GIB - spec_state - mamba
    tokens = int(kv // model.kv_bytes_per_token(tp, draft=launch.speculative))
    estimated = max(min(int(tokens / model.context_len * 512), 4096), 2048)
    cap = min(resolved if resolved is not None else estimated, tokens // 2, slots // ratio)
    return Sizing(free_gib=free_gib, static_gib=static, weights_gib=weights, pool_gib=pool,
                  mamba_slots=slots, mamba_gib=mamba / GIB, spec_state_gib=spec_state / GIB,
                  kv_gib=kv / GIB, kv_tokens=tokens, max_running=cap,
                  resolved_max_running=resolved if resolved is not None else estimated)


# --- deployments ------------------------------------------------------------------------------

# The MTP flags of docker/compose.yaml: --speculative-num-steps 1, topk 1, draft tokens 2.
PAIR_DRAFT_TOKENS = 2
# --speculative-adaptive (0.5.23): candidate steps [0, 1, 3, 5, 7]; left unset, the starting
# steps are the middle candidate, 3, and draft tokens 4 (speculative_hook.py
# _init_adaptive_speculative_params), which is what the memory is sized for.
ADAPTIVE_DRAFT_TOKENS = 4

# A server that owns the GPU: the fraction of free memory each single server keeps. Fitted to
# the seed's measured caps (its flags are not in the seed): with BF16 weights on 4x RTX PRO 6000,
# plain ran 68 requests (2,800 tok/s / 41 tok/s per request), which SGLang's sizing gives at
# 0.873 (340 Mamba slots / 5); MTP ran 24 of 48, which it gives at 0.75 (122 slots). At the
# plain server's 0.873 SGLang 0.5.23 would give the seed's MTP server 46, not 24: the seed's
# 24 may come from an older release's sizing or an explicit fraction; we keep the measurement.
SINGLE_FRACTIONS = {"plain": 0.873, "mtp": 0.75, "adaptive": 0.75}
SEED_WEIGHTS = "bf16"  # the seed names Qwen3.5-122B-A10B (BF16), one server on the GPUs at a time
PAIR_WEIGHTS = "fp8"  # two copies of BF16 (2 x 244 GB) do not fit on 4 x 96 GB


def launch_for(role: str, fraction: float, weights: str) -> Launch:
    """The launch of a ``plain``, ``mtp`` or ``adaptive`` server."""
    if role == "plain":
        return Launch(fraction, weights=weights)
    if role == "mtp":
        return Launch(fraction, speculative=True, num_draft_tokens=PAIR_DRAFT_TOKENS, weights=weights)
    if role == "adaptive":
        return Launch(fraction, speculative=True, num_draft_tokens=ADAPTIVE_DRAFT_TOKENS, weights=weights)
    raise ValueError(f"unknown server role {role!r}")


def size_pair(hardware: Hardware, fractions: tuple[float, float] | None = None,
              weights: str = PAIR_WEIGHTS, model: ModelConfig = QWEN35_122B,
              launch: Callable[[str, float, str], Launch] = launch_for) -> dict[str, Sizing]:
    """The compose pair: MTP starts first on the empty GPUs, plain on what MTP left.
    ``launch(role, fraction, weights)``: each server's flags (default: SGLang's pair)."""
    mtp_fraction, plain_fraction = fractions or hardware.pair_fractions
    mtp = size_server(launch("mtp", mtp_fraction, weights), hardware.free_at_start_gib, hardware, model)
    left = hardware.free_at_start_gib - mtp.static_gib - hardware.runtime_overhead_gib
    plain = size_server(launch("plain", plain_fraction, weights), left, hardware, model)
    return {"mtp": mtp, "plain": plain}


def size_single(role: str, hardware: Hardware, weights: str = PAIR_WEIGHTS,
                fraction: float | None = None, model: ModelConfig = QWEN35_122B) -> Sizing:
    """One server owning the GPUs."""
    fraction = SINGLE_FRACTIONS[role] if fraction is None else fraction
    return size_server(launch_for(role, fraction, weights), hardware.free_at_start_gib, hardware, model)


# --- the turns shape: the servers take turns owning the GPUs -----------------------------------
#
# With the memory saver (--enable-memory-saver, --enable-weights-cpu-backup) a server can be
# parked: paused (a release needs an idle scheduler,
# managers/scheduler_components/weight_updater.py:337-341), then its "kv_cache", "weights" and
# "cuda_graph" regions released (the same file, L365-366, L368-374, L376-377). Started in this
# order, each server is sized for the whole GPU less what the parked one still holds:
#   1. the first server starts alone and sizes on F0 (mem_fraction_static applies to the memory
#      free when it starts, bootstrap.py:193-223);
#   2. it is parked, keeping only its leftovers (released_leftovers_gib);
#   3. the second server measures F0 - leftovers of the first (held at the gate,
#      --gated-launch-port, until then: bootstrap.py:200-202, gated_launch.py:92-95), sizes and
#      runs; from then on the two take turns.
# A server resumed while the other is parked needs its static pool and graphs back beside the
# other's leftovers: for the first that is (1 - f) * F0 >= its runtime overhead + the second's
# leftovers. A resume that does not fit never answers (memory-turns.md), so size_turns refuses
# fractions that do not leave that room.

# Which server starts first in the turns shape: plain, the one whose pool grows with memory, gets
# the whole GPU; MTP (capped at 48 by speculation) starts second and holds the GPU when the
# gateway comes up, which is the low-load side.
TURNS_FIRST = "plain"


def named_buffer_clone_gib(hardware: Hardware, model: ModelConfig = QWEN35_122B) -> float:
    """What releasing "weights" leaves on the GPU: a clone of the model's named buffers.

    weight_updater.py:368-374 stashes ``_export_static_state`` (L478-483:
    ``buffer.detach().clone()`` for each of ``model.named_buffers()``) before pausing the
    weights, outside any memory-saver region; it is freed only on resume (L396-403).
    """
    del hardware  # replicated on each rank, the same at any TP
    return model.named_buffer_bytes() / GIB


def released_leftovers_gib(hardware: Hardware, cuda_graphs_released: bool = True,
                           model: ModelConfig = QWEN35_122B) -> dict[str, float]:
    """What a parked (released) server still holds per GPU, by part (GiB)."""
    held = {
        "cuda context, NCCL and custom all-reduce": hardware.start_overhead_gib,
        "attention and logits buffers": ATTENTION_AND_LOGITS_BUFFERS_GIB,
        "named buffers' clone": named_buffer_clone_gib(hardware, model),
    }
    if not cuda_graphs_released:
        held["CUDA graphs (no SGLANG_MEMORY_SAVER_CUDA_GRAPH=1)"] = CUDA_GRAPHS_GIB
    return held


@dataclass(frozen=True)
class TurnsSizing:
    """Both servers of a turns pair, each sized while the other was parked."""

    first: str  # the role that started alone on the empty GPUs
    servers: dict[str, Sizing]
    leftovers_gib: dict[str, float]  # per role: what it holds per GPU while parked
    resume_margin_gib: dict[str, float]  # per role: GPU memory to spare while it runs
    host_gib: float  # host memory for the retained copies, whole node (all GPUs)


def turns_leftover_total(hardware: Hardware, cuda_graphs_released: bool,
                         model: ModelConfig = QWEN35_122B) -> float:
    return sum(released_leftovers_gib(hardware, cuda_graphs_released, model).values())


def size_turns(hardware: Hardware, fractions: tuple[float, float] | None = None,
               weights: str = PAIR_WEIGHTS, first: str = TURNS_FIRST,
               cuda_graphs_released: bool = True, model: ModelConfig = QWEN35_122B) -> TurnsSizing:
    """The turns pair: ``first`` sizes on the empty GPU, is parked, the other sizes on the rest.

    ``fractions`` is ``(MEM_FRACTION_MTP, MEM_FRACTION_PLAIN)`` as for size_pair. Raises
    ValueError when a server, resumed beside the other's leftovers, would not fit.
    """
    if first not in ("mtp", "plain"):
        raise ValueError(f"unknown first server {first!r} (mtp or plain)")
    second = "plain" if first == "mtp" else "mtp"
    fraction = dict(zip(("mtp", "plain"), fractions or hardware.turns_fractions, strict=True))
    leftover = turns_leftover_total(hardware, cuda_graphs_released, model)
    free = {first: hardware.free_at_start_gib, second: hardware.free_at_start_gib - leftover}
    servers = {role: size_server(launch_for(role, fraction[role], weights), free[role], hardware, model)
               for role in (first, second)}
    margin = {role: hardware.gpu_gib - (hardware.start_overhead_gib + servers[role].static_gib
                                        + hardware.runtime_overhead_gib + leftover)
              for role in servers}
    for role, spare in margin.items():
        if spare < 0:
            other = second if role == first else first
            raise ValueError(
                f"unsafe turns fractions: the {role} server (--mem-fraction-static="
                f"{fraction[role]}, {servers[role].static_gib:.1f} GiB static of "
                f"{servers[role].free_gib:.1f} GiB free) needs {-spare:.1f} GiB more per GPU to "
                f"resume beside the parked {other} server's {leftover:.1f} GiB and its own "
                f"{hardware.runtime_overhead_gib:.1f} GiB of graphs and activations; a resume "
                f"that does not fit never answers. Lower its fraction.")
    host = turns_host_gib(hardware, weights, cuda_graphs_released, model)
    return TurnsSizing(first=first, servers=servers, leftovers_gib={r: leftover for r in servers},
                       resume_margin_gib=margin, host_gib=host)


def turns_host_gib(hardware: Hardware, weights: str = PAIR_WEIGHTS, cuda_graphs_released: bool = True,
                   model: ModelConfig = QWEN35_122B) -> float:
    """Host memory the retained copies take on one node, both servers, all GPUs (GiB).

    Each server keeps one host copy of its weights (target and draft:
    --enable-weights-cpu-backup covers both, model_runner_components/load_model_utils.py:307-309)
    from its first pause on, with TMS_RETAIN_CPU_BACKUP=1; pausable CUDA graphs are backed up
    too (full_cuda_graph_backend.py:185-193, enable_cpu_backup=True). The KV cache is dropped,
    not copied.
    """
    per_gpu = sum(size_server_weights_gib(role, hardware, weights, model) for role in ("mtp", "plain"))
    if cuda_graphs_released:
        per_gpu += 2 * CUDA_GRAPHS_GIB
    return per_gpu * hardware.gpus


def size_server_weights_gib(role: str, hardware: Hardware, weights: str = PAIR_WEIGHTS,
                            model: ModelConfig = QWEN35_122B) -> float:
    """One server's weights on one GPU (target, and the draft for MTP)."""
    total = model.weight_bytes(weights)
    if role != "plain":
        total += model.draft_weight_bytes(weights)
    return total / hardware.gpus / GIB


def with_sizing(profile: Profile, sizing: Sizing) -> Profile:
    """A simulator profile with the caps and cache a memory sizing gives it."""
    return replace(profile, mamba_slots=sizing.mamba_slots, mamba_slots_per_request=MAMBA_SLOTS_PER_REQUEST,
                   max_running_requests=sizing.resolved_max_running,
                   prefix_cache_tokens=sizing.kv_tokens)


# --- docker/README.md's table ------------------------------------------------------------------

def _gb(x: float) -> str:
    return f"{x:.1f}"


def sizing_table(hardware_names: tuple[str, ...] = ("rtx-pro-6000", "h200")) -> str:
    """Both shapes' sizing per GPU (split, turns) and the single servers, as Markdown."""
    hws = [HARDWARE[n] for n in hardware_names]
    pairs = [size_pair(hw) for hw in hws]
    turns = [size_turns(hw) for hw in hws]
    singles = [{role: size_single(role, hw) for role in ("plain", "mtp")} for hw in hws]

    def row(label: str, cells: list[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = [row("per GPU, FP8, TP 4", [hw.label for hw in hws]), "|---|" + "---|" * len(hws)]
    lines.append(row("free at first start `F0`", [f"{hw.free_at_start_gib:.1f} GiB" for hw in hws]))
    lines.append(row("**split** (`compose.yaml`): `MEM_FRACTION_MTP`, MTP started first", [
        f"{hw.pair_fractions[0]} → {_gb(p['mtp'].static_gib)} GiB static: weights + draft "
        f"{_gb(p['mtp'].weights_gib)}, pools {_gb(p['mtp'].pool_gib)}"
        for hw, p in zip(hws, pairs, strict=True)]))
    lines.append(row("MTP server: Mamba slots / running cap / KV tokens", [
        f"{p['mtp'].mamba_slots} / **{p['mtp'].max_running}** (of {p['mtp'].resolved_max_running}) / "
        f"{p['mtp'].kv_tokens:,}" for p in pairs]))
    lines.append(row(f"left after MTP (−{hws[0].runtime_overhead_gib:g} GiB graphs/activations) `F1`",
                     [f"{_gb(p['plain'].free_gib)} GiB" for p in pairs]))
    lines.append(row("`MEM_FRACTION_PLAIN`", [
        f"{hw.pair_fractions[1]} → {_gb(p['plain'].static_gib)} GiB static: weights "
        f"{_gb(p['plain'].weights_gib)}, pools {_gb(p['plain'].pool_gib)}; "
        f"{_gb((1 - hw.pair_fractions[1]) * p['plain'].free_gib)} GiB for its graphs"
        for hw, p in zip(hws, pairs, strict=True)]))
    lines.append(row("plain server: Mamba slots / running cap / KV tokens", [
        f"{p['plain'].mamba_slots} / **{p['plain'].max_running}** / {p['plain'].kv_tokens:,}"
        for p in pairs]))
    lines.extend(_turns_rows(hws, turns, row))
    for role, fraction_note in (("plain", "plain"), ("mtp", "MTP")):
        lines.append(row(f"for comparison: one {fraction_note} server owning the GPU "
                         f"(fraction {SINGLE_FRACTIONS[role]}): pools / running cap / KV tokens", [
                             f"{_gb(s[role].pool_gib)} GiB / **{s[role].max_running}** / "
                             f"{s[role].kv_tokens:,}"
                             for s in singles]))
    return "\n".join(lines)


def _turns_rows(hws: list[Hardware], turns: list[TurnsSizing],
                row: Callable[[str, list[str]], str]) -> list[str]:
    first = turns[0].first
    second = "mtp" if first == "plain" else "plain"
    name = {"mtp": "MTP", "plain": "plain"}
    variable = {"mtp": "MEM_FRACTION_MTP", "plain": "MEM_FRACTION_PLAIN"}
    draft = {"mtp": "weights + draft", "plain": "weights"}

    def static(role: str) -> list[str]:
        return [f"{fraction} of {_gb(t.servers[role].free_gib)} → {_gb(t.servers[role].static_gib)} GiB "
                f"static: {draft[role]} {_gb(t.servers[role].weights_gib)}, pools "
                f"{_gb(t.servers[role].pool_gib)}"
                for hw, t in zip(hws, turns, strict=True)
                for fraction in [dict(zip(("mtp", "plain"), hw.turns_fractions, strict=True))[role]]]

    def caps(role: str) -> list[str]:
        return [f"{s.mamba_slots} / **{s.max_running}**"
                + (f" (of {s.resolved_max_running})" if role == "mtp" else "") + f" / {s.kv_tokens:,}"
                for t in turns for s in [t.servers[role]]]

    leftovers = released_leftovers_gib(hws[0])
    host = hicache_host_memory(tuple(hw.name for hw in hws))
    parts = "; ".join(f"{part} {value:.2f}" for part, value in leftovers.items())
    return [
        row(f"**turns** (`compose.turns.yaml`): `{variable[first]}`, {name[first]} started first "
            "on `F0`", static(first)),
        row(f"{name[first]} server: Mamba slots / running cap / KV tokens", caps(first)),
        row(f"a parked server still holds ({parts} GiB; graphs released with "
            "`SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`)",
            [f"{_gb(t.leftovers_gib[first])} GiB" for t in turns]),
        row(f"`{variable[second]}`, {name[second]} started on `F0` − the parked {name[first]}'s "
            "leftovers", static(second)),
        row(f"{name[second]} server: Mamba slots / running cap / KV tokens", caps(second)),
        row(f"spare while running beside the other's leftovers ({name[first]} / {name[second]}; "
            "must stay ≥ 0)", [f"{_gb(t.resume_margin_gib[first])} / {_gb(t.resume_margin_gib[second])} GiB"
                               for t in turns]),
        row("host memory without prefix stores (`compose.turns.yaml`): the retained copies, both "
            "servers' weights + graphs, whole node", [f"{t.host_gib:.0f} GiB" for t in turns]),
        row(f"host memory with each server's own prefix store (`{STORE_OVERRIDE}`), whole node",
            [f"**{_pair_total_gib(host):.0f} GiB**"] * len(hws)),
        *(row(f"{name[role]} server's host memory with its own prefix store: retained copy, HiCache "
              "host tier, L3 tmpfs", [_host_memory_cell(host[role], markdown=True)] * len(hws))
          for role in (first, second)),
    ]


# --- docker/compose*.yaml's sizing comments ---------------------------------------------------

COMPOSE_BEGIN = "# sizing: generated by `python -m gateway.sim.memory --compose {shape}`, do not edit"
COMPOSE_END = "# end of sizing"


COMPOSE_SHAPES = ("split", "turns", "turns-store", "vllm-turns")


def compose_sizing(shape: str, hardware_names: tuple[str, ...] = ("rtx-pro-6000", "h200")) -> str:
    """The sizing comment block of docker/compose.yaml (``split``), compose.turns.yaml (``turns``),
    its override compose.turns-store.yaml (``turns-store``: each server's host memory with its
    own prefix store) or compose.vllm-turns.yaml (``vllm-turns``: the host memory of a level-1
    sleep)."""
    if shape not in COMPOSE_SHAPES:
        raise ValueError(f"unknown shape {shape!r} ({', '.join(COMPOSE_SHAPES)})")
    if shape in ("turns-store", "vllm-turns"):
        body = (_host_memory_lines(hardware_names) if shape == "turns-store"
                else _compose_vllm_turns(hardware_names))
        return "\n".join([COMPOSE_BEGIN.format(shape=shape), *body, COMPOSE_END])
    lines = [COMPOSE_BEGIN.format(shape=shape),
             "# Per GPU at TP 4 with FP8 weights, as SGLang 0.5.23 sizes each server (gateway/sim/memory.py;",
             "# derived, not measured: check each server's startup log, docker/README.md):"]
    for name in hardware_names:
        hw = HARDWARE[name]
        lines.append(f"#   {hw.label}: F0 = {_gb(hw.free_at_start_gib)} GiB free at the first start")
        lines.extend(_compose_split(hw) if shape == "split" else _compose_turns(hw))
    if shape == "turns":
        lines.extend(_host_memory_summary_lines(hardware_names))
    lines.append(COMPOSE_END)
    return "\n".join(lines)


def _server_lines(variable: str, fraction: float, sizing: Sizing, role: str, note: str) -> str:
    weights = "weights + draft" if role == "mtp" else "weights"
    cap = f"cap {sizing.max_running}" + (f" of {sizing.resolved_max_running}" if role == "mtp" else "")
    return (f"#     {variable}={fraction} x {_gb(sizing.free_gib)}{note} = {_gb(sizing.static_gib)} GiB "
            f"static\n#       ({weights} {_gb(sizing.weights_gib)}, pools {_gb(sizing.pool_gib)}): {cap}, "
            f"{sizing.kv_tokens:,} KV tokens")


def _compose_split(hw: Hardware) -> list[str]:
    pair = size_pair(hw)
    mtp_fraction, plain_fraction = hw.pair_fractions
    return [
        _server_lines("MEM_FRACTION_MTP", mtp_fraction, pair["mtp"], "mtp", " (F0)"),
        _server_lines("MEM_FRACTION_PLAIN", plain_fraction, pair["plain"], "plain",
                     f" (left after MTP and its ~{hw.runtime_overhead_gib:g} GiB of graphs)"),
    ]


def _compose_turns(hw: Hardware) -> list[str]:
    turns = size_turns(hw)
    first, second = turns.first, ("mtp" if turns.first == "plain" else "plain")
    fraction = dict(zip(("mtp", "plain"), hw.turns_fractions, strict=True))
    variable = {"mtp": "MEM_FRACTION_MTP", "plain": "MEM_FRACTION_PLAIN"}
    return [
        _server_lines(variable[first], fraction[first], turns.servers[first], first,
                     f" (F0, {first} first)"),
        f"#     parked, the {first} server keeps {_gb(turns.leftovers_gib[first])} GiB "
        "(context, NCCL, buffers; graphs released)",
        _server_lines(variable[second], fraction[second], turns.servers[second], second,
                     f" (F0 - {first}'s leftovers)"),
        f"#     spare while each runs beside the other's leftovers: {first} "
        f"{_gb(turns.resume_margin_gib[first])}, {second} {_gb(turns.resume_margin_gib[second])} GiB "
        "(must stay >= 0)",
        f"#     host memory for the two retained weight copies (+ graphs): {turns.host_gib:.0f} GiB",
    ]


# --- the turns pair's host memory: weight copies, HiCache host tier, L3 store --------------------
# Opt-in (docker/compose.turns-store.yaml, deploy/k8s/overlays/pair-turns-store): each server of a
# turns pair keeps its own L3 store of prefix pages, SGLang's file backend on a RAM-backed tmpfs,
# so that on its next turn its sessions load their context instead of prefilling it
# (docs/compat.md, "Keeping the prefix caches across a turn": a release flushes the host tier,
# urc:448-451, and leaves L3 alone). The flags are the override's; the sizes are here.

STORE_OVERRIDE = "compose.turns-store.yaml"

HICACHE_PAGE_TOKENS = 64  # --page-size on both servers: one L3 object per 64 tokens per rank
# The host tier (--hicache-size, GB = 1e9 B per rank process: mem_cache/pool_host/base.py:221-224)
# is flushed at every release, so it only stages pages: a prefetch may take at most half of it
# (managers/cache_controller.py:631-636), so it holds twice the longest prefix, the model's context
# window, in the tier's KV share (the size is split between the KV and Mamba pools in proportion
# to their device bytes: mem_cache/hybrid_cache/hybrid_pool_assembler.py:239-254).
HOST_TIER_PREFIXES = 2
# The L3 store (max_size, per rank's own files: mem_cache/storage/file/lru_file_evictor.py:56-150)
# holds the sessions at work at a turn, about the session crossover (22, config.yaml) with room,
# each with its context and a few Mamba states (one per request inserted: one per radix node,
# mem_cache/unified_cache/components/mamba.py:227-253). Assumptions, not measurements: agent
# contexts grow to 167k tokens before Claude Code compacts (gateway/bench/agent.py); 64k is taken
# as a typical one. Past the cap the store evicts its least recently used pages.
L3_SESSIONS = 32
L3_CONTEXT_TOKENS = 64_000
L3_STATES_PER_SESSION = 4
TMPFS_MARGIN_GIB = 1  # files being written (tmp, then renamed: hicache_storage.py:883-927)


@dataclass(frozen=True)
class HostMemory:
    """One turns server's host memory on its node (all its ranks), and the flags that size it."""

    role: str
    ranks: int
    retained_gib: float  # its weights (+ draft) and CUDA graphs, kept by TMS_RETAIN_CPU_BACKUP=1
    hicache_size_gb: int  # --hicache-size: GB per rank
    l3_cap_gib: int  # max_size per rank (its own files)

    @property
    def host_tier_gib(self) -> float:
        return self.hicache_size_gb * GB * self.ranks / GIB

    @property
    def tmpfs_gib(self) -> int:
        """The RAM-backed volume its L3 directory lives on: every rank's cap, and the margin."""
        return self.l3_cap_gib * self.ranks + TMPFS_MARGIN_GIB

    @property
    def total_gib(self) -> float:
        return self.retained_gib + self.host_tier_gib + self.tmpfs_gib


def hicache_host_memory(hardware_names: tuple[str, ...] = ("rtx-pro-6000", "h200"),
                        model: ModelConfig = QWEN35_122B) -> dict[str, HostMemory]:
    """Each turns server's host memory; one size per role for every hardware named (the deploy
    files have one): the largest."""
    hws = [HARDWARE[name] for name in hardware_names]
    ranks = {hw.gpus for hw in hws}
    if len(ranks) != 1:
        raise ValueError(f"one TP size for every hardware, not {sorted(ranks)}")
    (tp,) = ranks
    sizings = [size_turns(hw) for hw in hws]
    memory = {}
    for role in ("plain", "mtp"):
        kv_token = model.kv_bytes_per_token(tp, draft=role == "mtp")
        share = min(s.servers[role].kv_gib / (s.servers[role].kv_gib + s.servers[role].mamba_gib)
                    for s in sizings)
        host_tier = HOST_TIER_PREFIXES * model.context_len * kv_token / share
        l3 = L3_SESSIONS * (L3_CONTEXT_TOKENS * kv_token
                            + L3_STATES_PER_SESSION * model.mamba_bytes_per_request(tp))
        retained = max((size_server_weights_gib(role, hw, model=model) + CUDA_GRAPHS_GIB) * hw.gpus
                       for hw in hws)
        memory[role] = HostMemory(role, tp, retained, math.ceil(host_tier / GB), math.ceil(l3 / GIB))
    return memory


def hicache_extra_config(memory: HostMemory) -> str:
    """--hicache-storage-backend-extra-config: the server's own directory and its cap."""
    return json.dumps({"file_storage_path": hicache_directory(memory.role),
                       "max_size": f"{memory.l3_cap_gib}Gi"})


def hicache_directory(role: str) -> str:
    """Each server's own L3 directory, on its own tmpfs: never one shared by the two (the plain
    server would read the MTP server's 13-layer pages as its own 12: docs/compat.md)."""
    return f"/hicache-{role}"


def _pair_total_gib(memory: dict[str, HostMemory]) -> float:
    return sum(m.total_gib for m in memory.values())


def _host_memory_summary_lines(hardware_names: tuple[str, ...]) -> list[str]:
    """compose.turns.yaml's two host-memory rows: the pair as it is, and with the override."""
    memory = hicache_host_memory(hardware_names)
    plain, mtp = memory["plain"], memory["mtp"]
    return [
        f"#   Host memory per server, either hardware (TP {plain.ranks}):",
        f"#     without prefix stores (this file): plain {plain.retained_gib:.1f} GiB (weights + graphs),",
        f"#       mtp {mtp.retained_gib:.1f} GiB (weights + draft + graphs): the pair "
        f"{sum(m.retained_gib for m in memory.values()):.0f} GiB",
        f"#     with each server's own prefix store ({STORE_OVERRIDE}, whose sizing block has",
        f"#       the parts): plain {plain.total_gib:.1f} GiB, mtp {mtp.total_gib:.1f} GiB: the pair "
        f"{_pair_total_gib(memory):.0f} GiB",
    ]


def _host_memory_lines(hardware_names: tuple[str, ...]) -> list[str]:
    """compose.turns-store.yaml's block: each server's host memory with its own store, part by part."""
    memory = hicache_host_memory(hardware_names)
    model = QWEN35_122B
    lines = ["#   Host memory per server, either hardware (TP 4): its retained copy, its HiCache host",
             "#   tier, its L3 store (a tmpfs of its own; docs/compat.md, \"Keeping the prefix caches",
             "#   across a turn\"):"]
    for role in ("plain", "mtp"):
        m = memory[role]
        lines += [f"#     {role}: {_host_memory_cell(m)}"]
    tp = memory["plain"].ranks
    lines += [
        f"#     the pair: {_pair_total_gib(memory):.0f} GiB of host memory (without the stores: "
        f"{sum(m.retained_gib for m in memory.values()):.0f} GiB)",
        f"#     (host tier: {HOST_TIER_PREFIXES} x the {model.context_len:,}-token context window; L3: "
        f"{L3_SESSIONS} sessions x {L3_CONTEXT_TOKENS:,} tokens",
        f"#     + {L3_STATES_PER_SESSION} Mamba states each; KV {model.kv_bytes_per_token(tp, False):,} "
        f"(plain) / {model.kv_bytes_per_token(tp, True):,} (MTP) B a token a rank,",
        f"#     a Mamba state {model.mamba_bytes_per_request(tp):,} B a rank)",
    ]
    return lines


def _host_memory_cell(m: HostMemory, markdown: bool = False) -> str:
    """One server's host memory, as a compose comment (two lines) or a Markdown cell."""
    total = f"{m.total_gib:.1f} GiB"
    newline, total = (" ", f"**{total}**") if markdown else ("\n#       ", total)
    return (f"weights{' + draft' if m.role == 'mtp' else ''} + graphs {m.retained_gib:.1f} GiB "
            f"+ host tier {m.hicache_size_gb} GB x {m.ranks} ranks (--hicache-size) "
            f"{m.host_tier_gib:.1f} GiB{newline}+ L3 {m.l3_cap_gib} GiB x {m.ranks} ranks (max_size) "
            f"on a tmpfs of {m.tmpfs_gib} GiB = {total}")


def _compose_vllm_turns(hardware_names: tuple[str, ...]) -> list[str]:
    """vLLM 0.33.0's level-1 sleep copies the sleeping server's weights (target and MTP draft) to
    pinned host memory allocated at the sleep and freed at the wake (device_allocator/cumem.py
    :255-298, :355-360); one server sleeps at a time. The weights are this module's (FP8, TP 4).
    The "runtime" and "cudagraph" pools are offloaded too (device_allocator/sleep_mode_backend.py
    :127-137) and are not counted: the graphs are in that pool only with
    --sleep-mode-offload-cudagraph."""
    lines = ["# Host memory of a level-1 sleep: the sleeping server's weights (target + MTP draft) in pinned",
             "# host memory, allocated at each sleep and freed at its wake; one server sleeps at a time.",
             "# Per node at TP 4 with FP8 weights (gateway/sim/memory.py's weight sizes; approximate: vLLM's",
             "# own buffers and any pool it offloads besides the weights are not counted, and the CUDA",
             "# graphs stay on the GPU without --sleep-mode-offload-cudagraph):"]
    for name in hardware_names:
        hw = HARDWARE[name]
        weights = {role: size_server_weights_gib(role, hw) for role in ("mtp", "plain")}
        lines.append(f"#   {hw.label}: plain asleep {weights['plain'] * hw.gpus:.0f} GiB, mtp asleep "
                     f"{weights['mtp'] * hw.gpus:.0f} GiB ({_gb(weights['plain'])} and "
                     f"{_gb(weights['mtp'])} GiB per GPU): budget {max(weights.values()) * hw.gpus:.0f} GiB")
    return lines


TABLE_BEGIN = "<!-- sizing table: generated by `python -m gateway.sim.memory`, do not edit -->"
TABLE_END = "<!-- end of sizing table -->"


def main(argv: list[str] | None = None) -> None:
    """``python -m gateway.sim.memory``: docker/README.md's table; ``--compose SHAPE``: that
    compose file's sizing comment (compose_sizing says which file)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gateway.sim.memory", description=main.__doc__)
    parser.add_argument("--compose", choices=COMPOSE_SHAPES,
                        help="print a compose file's block")
    args = parser.parse_args(argv)
    if args.compose:
        print(compose_sizing(args.compose))
        return
    print(TABLE_BEGIN)
    print(sizing_table())
    print(TABLE_END)


if __name__ == "__main__":
    main()
