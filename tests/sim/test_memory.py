"""The memory model: capacities from GPU memory, weights and SGLang 0.5.23's sizing."""

import re
from pathlib import Path

import pytest

from gateway.sim import memory
from gateway.sim.memory import HARDWARE, QWEN35_122B, size_pair, size_server, size_single
from gateway.sim.profile import pair_profiles, seed_profiles, single_profile

ROOT = Path(__file__).resolve().parents[2]
RTX, H200 = HARDWARE["rtx-pro-6000"], HARDWARE["h200"]


def test_state_and_kv_bytes_follow_the_config():
    # Per GPU at TP 4, 36 Gated DeltaNet layers: conv (64*128 + 2*16*128) / 4 x 3 taps in bf16,
    # SSM 64/4 heads x 128 x 128 in float32; KV: 12 full-attention layers, 1 of 2 KV heads x 256.
    assert QWEN35_122B.mamba_bytes_per_request(4) == (3072 * 3 * 2 + 16 * 128 * 128 * 4) * 36
    assert QWEN35_122B.kv_bytes_per_token(4, draft=False) == 12 * 2 * 256 * 2
    assert QWEN35_122B.kv_bytes_per_token(4, draft=True) == 13 * 2 * 256 * 2


def test_seed_single_servers_get_the_seed_caps():
    seed = seed_profiles()
    assert (seed["plain"].mamba_slots, seed["plain"].effective_max_running) == (340, 68)
    assert (seed["mtp"].mamba_slots, seed["mtp"].effective_max_running) == (120, 24)
    assert seed["mtp"].resolved_max_running_requests == 48


def compose_default(variable: str) -> float:
    text = (ROOT / "docker" / "compose.yaml").read_text()
    return float(re.search(r"\$\{" + variable + r":-([0-9.]+)\}", text).group(1))


def test_pair_caps_derive_from_the_compose_split():
    assert RTX.pair_fractions == (compose_default("MEM_FRACTION_MTP"), compose_default("MEM_FRACTION_PLAIN"))
    pair = size_pair(RTX)
    assert (pair["mtp"].mamba_slots, pair["mtp"].max_running) == (120, 24)
    assert (pair["plain"].mamba_slots, pair["plain"].max_running) == (144, 28)
    h200 = size_pair(H200)
    assert (h200["mtp"].max_running, h200["plain"].max_running) == (48, 100)
    assert {n: p.effective_max_running for n, p in pair_profiles().items()} == {"mtp": 24, "plain": 28}
    assert pair_profiles()["plain"].prefix_cache_tokens == pair["plain"].kv_tokens


def test_second_server_sizes_from_what_the_first_left():
    pair = size_pair(RTX)
    assert pair["mtp"].free_gib == pytest.approx(RTX.free_at_start_gib)
    assert pair["plain"].free_gib == pytest.approx(
        RTX.free_at_start_gib - pair["mtp"].static_gib - RTX.runtime_overhead_gib)
    bigger_mtp = size_pair(RTX, fractions=(0.5, 0.85))
    assert bigger_mtp["plain"].max_running < pair["plain"].max_running
    assert bigger_mtp["mtp"].max_running > pair["mtp"].max_running


def test_a_server_that_owns_the_gpu_has_far_more_than_its_pair_twin():
    alone = size_single("plain", RTX)
    assert alone.weights_gib == pytest.approx(size_pair(RTX)["plain"].weights_gib)
    assert alone.max_running > 4 * size_pair(RTX)["plain"].max_running
    assert size_single("mtp", RTX).max_running == 48  # speculation's cap, not memory
    assert single_profile("adaptive").effective_max_running == 48


def test_weights_that_do_not_fit_are_an_error_like_sglang():
    # Two BF16 copies (57 GiB per GPU each) cannot share a 96 GB GPU.
    with pytest.raises(ValueError, match="Loaded weights leave no GPU memory"):
        size_pair(RTX, weights="bf16")
    with pytest.raises(ValueError, match="unknown weight precision"):
        size_single("plain", RTX, weights="int3")


def test_speculation_reserves_draft_token_states():
    launch = memory.launch_for("plain", 0.8, "fp8")
    spec = memory.Launch(0.8, speculative=True, num_draft_tokens=4, max_running_requests=4096)
    plain = size_server(launch, RTX.free_at_start_gib, RTX)
    mtp = size_server(spec, RTX.free_at_start_gib, RTX)
    assert mtp.spec_state_gib > 0 and plain.spec_state_gib == 0
    assert mtp.mamba_slots < plain.mamba_slots


def test_docker_readme_table_is_the_generated_one():
    readme = (ROOT / "docker" / "README.md").read_text()
    start, end = readme.index(memory.TABLE_BEGIN), readme.index(memory.TABLE_END)
    written = readme[start + len(memory.TABLE_BEGIN):end].strip()
    assert written == memory.sizing_table(), "regenerate with `python -m gateway.sim.memory`"
