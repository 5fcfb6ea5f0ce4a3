"""Where a simulated server's capacities come from: GPU memory, weights, and SGLang's sizing.

SGLang 0.5.23 sizes one server like this (file:line in the 0.5.23 wheel, /work/sglang-src):

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

from dataclasses import dataclass, replace

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

    def kv_bytes_per_token(self, tp: int, draft: bool) -> int:
        """K and V of one token on one GPU; KV heads are replicated when tp > heads."""
        heads = max(1, self.num_kv_heads // tp)
        layers = self.full_attention_layers + (self.draft_layers if draft else 0)
        return layers * 2 * heads * self.head_dim * self.kv_bytes


QWEN35_122B = ModelConfig()


@dataclass(frozen=True)
class Hardware:
    """One node: ``gpus`` GPUs of ``gpu_gib`` as CUDA reports them, tensor parallel over all."""

    name: str
    label: str
    gpus: int
    gpu_gib: float
    # Used before a server measures its free memory: CUDA context + NCCL communicators
    # (SGLang measures after parallel init). About 1 GiB at TP 4; an estimate.
    start_overhead_gib: float = 1.0
    # What a started server holds beyond its static pool: CUDA graphs, activation cache,
    # NCCL buffers. The second server of a pair sees the free memory after it. "A few GB per
    # GPU at TP 4" (docker/README.md); an estimate to replace with nvidia-smi on real GPUs.
    runtime_overhead_gib: float = 5.0
    # The compose split recommended for this hardware: (MEM_FRACTION_MTP, MEM_FRACTION_PLAIN).
    pair_fractions: tuple[float, float] = (0.45, 0.85)

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
    budget = pool * GIB * MAMBA_FULL_MEMORY_RATIO / (1 + MAMBA_FULL_MEMORY_RATIO)
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
              weights: str = PAIR_WEIGHTS, model: ModelConfig = QWEN35_122B) -> dict[str, Sizing]:
    """The compose pair: MTP starts first on the empty GPUs, plain on what MTP left."""
    mtp_fraction, plain_fraction = fractions or hardware.pair_fractions
    mtp = size_server(launch_for("mtp", mtp_fraction, weights), hardware.free_at_start_gib, hardware, model)
    left = hardware.free_at_start_gib - mtp.static_gib - hardware.runtime_overhead_gib
    plain = size_server(launch_for("plain", plain_fraction, weights), left, hardware, model)
    return {"mtp": mtp, "plain": plain}


def size_single(role: str, hardware: Hardware, weights: str = PAIR_WEIGHTS,
                fraction: float | None = None, model: ModelConfig = QWEN35_122B) -> Sizing:
    """One server owning the GPUs."""
    fraction = SINGLE_FRACTIONS[role] if fraction is None else fraction
    return size_server(launch_for(role, fraction, weights), hardware.free_at_start_gib, hardware, model)


def with_sizing(profile, sizing: Sizing):
    """A simulator profile with the caps and cache a memory sizing gives it."""
    return replace(profile, mamba_slots=sizing.mamba_slots, mamba_slots_per_request=MAMBA_SLOTS_PER_REQUEST,
                   max_running_requests=sizing.resolved_max_running,
                   prefix_cache_tokens=sizing.kv_tokens)


# --- docker/README.md's table ------------------------------------------------------------------

def _gb(x: float) -> str:
    return f"{x:.1f}"


def sizing_table(hardware_names: tuple[str, ...] = ("rtx-pro-6000", "h200")) -> str:
    """The pair's sizing per GPU, and the single servers it is compared with, as Markdown."""
    hws = [HARDWARE[n] for n in hardware_names]
    pairs = [size_pair(hw) for hw in hws]
    singles = [{role: size_single(role, hw) for role in ("plain", "mtp")} for hw in hws]

    def row(label: str, cells: list[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = [row("per GPU, FP8, TP 4", [hw.label for hw in hws]), "|---|" + "---|" * len(hws)]
    lines.append(row("free at first start `F0`", [f"{hw.free_at_start_gib:.1f} GiB" for hw in hws]))
    lines.append(row("`MEM_FRACTION_MTP`", [
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
    for role, fraction_note in (("plain", "plain"), ("mtp", "MTP")):
        lines.append(row(f"for comparison: one {fraction_note} server owning the GPU "
                         f"(fraction {SINGLE_FRACTIONS[role]}): pools / running cap / KV tokens", [
                             f"{_gb(s[role].pool_gib)} GiB / **{s[role].max_running}** / "
                             f"{s[role].kv_tokens:,}"
                             for s in singles]))
    return "\n".join(lines)


TABLE_BEGIN = "<!-- sizing table: generated by `python -m gateway.sim.memory`, do not edit -->"
TABLE_END = "<!-- end of sizing table -->"


def main() -> None:
    print(TABLE_BEGIN)
    print(sizing_table())
    print(TABLE_END)


if __name__ == "__main__":
    main()
