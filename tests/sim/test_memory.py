"""The memory model: capacities from GPU memory, weights and SGLang 0.5.23's sizing."""

import os
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


# --- the turns shape --------------------------------------------------------------------------

def test_turns_second_server_sizes_on_the_gpu_less_the_parked_ones_leftovers():
    turns = memory.size_turns(RTX)
    assert turns.first == "plain"
    parked = sum(memory.released_leftovers_gib(RTX).values())
    assert turns.servers["plain"].free_gib == pytest.approx(RTX.free_at_start_gib)
    assert turns.servers["mtp"].free_gib == pytest.approx(RTX.free_at_start_gib - parked)
    # each is sized like a server owning the GPU, not like its split twin
    assert turns.servers["plain"].max_running == size_single("plain", RTX).max_running
    assert turns.servers["plain"].max_running > 4 * size_pair(RTX)["plain"].max_running
    assert turns.servers["mtp"].max_running == 48 > size_pair(RTX)["mtp"].max_running
    # started second, MTP has a little less than alone: the plain server's leftovers
    assert turns.servers["mtp"].kv_tokens < size_single("mtp", RTX).kv_tokens
    mtp_first = memory.size_turns(RTX, first="mtp")
    assert mtp_first.servers["plain"].kv_tokens < turns.servers["plain"].kv_tokens


def test_graphs_kept_by_a_parked_server_without_the_cuda_graph_saver():
    released = memory.released_leftovers_gib(RTX, cuda_graphs_released=True)
    kept = memory.released_leftovers_gib(RTX, cuda_graphs_released=False)
    assert sum(kept.values()) - sum(released.values()) == pytest.approx(memory.CUDA_GRAPHS_GIB)
    with_graphs = memory.size_turns(RTX, cuda_graphs_released=False)
    assert with_graphs.servers["mtp"].kv_tokens < memory.size_turns(RTX).servers["mtp"].kv_tokens
    # the graphs stay on the GPU, not in host memory
    graphs_on_host = 2 * RTX.gpus * memory.CUDA_GRAPHS_GIB
    assert with_graphs.host_gib == pytest.approx(memory.size_turns(RTX).host_gib - graphs_on_host)


def test_turns_headroom_must_cover_the_other_servers_leftovers():
    parked = sum(memory.released_leftovers_gib(RTX).values())
    # plain first at 0.94: alone it keeps 5.7 GiB for its 5 GiB of graphs and activations and
    # starts fine; beside the parked MTP server's leftovers a resume would not fit.
    assert (1 - 0.94) * RTX.free_at_start_gib > RTX.runtime_overhead_gib
    assert (1 - 0.94) * RTX.free_at_start_gib < RTX.runtime_overhead_gib + parked
    size_single("plain", RTX, fraction=0.94)
    with pytest.raises(ValueError, match="unsafe turns fractions: the plain server"):
        memory.size_turns(RTX, fractions=(0.75, 0.94))
    with pytest.raises(ValueError, match="unsafe turns fractions: the mtp server"):
        memory.size_turns(RTX, fractions=(0.97, 0.873))
    for hw in (RTX, H200):
        margins = memory.size_turns(hw).resume_margin_gib
        assert min(margins.values()) > 0
        first = memory.size_turns(hw)
        expected = (1 - hw.turns_fractions[1]) * hw.free_at_start_gib - hw.runtime_overhead_gib - parked
        assert first.resume_margin_gib["plain"] == pytest.approx(expected)


def test_turns_host_memory_is_one_retained_copy_of_each_servers_weights():
    turns = memory.size_turns(RTX)
    weights = turns.servers["plain"].weights_gib + turns.servers["mtp"].weights_gib
    assert turns.host_gib == pytest.approx(4 * (weights + 2 * memory.CUDA_GRAPHS_GIB))
    with pytest.raises(ValueError, match="unknown first server"):
        memory.size_turns(RTX, first="both")


SOURCE_LINES = ROOT / "tests" / "data" / "sglang_0.5.23_memory_saver_lines.txt"


def source_excerpts() -> dict[str, str]:
    excerpts: dict[str, str] = {}
    ref = None
    for line in SOURCE_LINES.read_text().splitlines():
        if line.startswith("== "):
            ref = line[3:]
            excerpts[ref] = ""
        elif ref is not None:
            excerpts[ref] += line + "\n"
    return excerpts


def test_leftover_constants_follow_the_source_lines():
    lines = source_excerpts()
    max_car = re.search(r"_MAX_CAR_SIZE = (\d+) \* (\d+)",
                        lines["distributed/device_communicators/custom_all_reduce.py:42"])
    # meta (+ max_size), IPC buffer and rank_data: three buffers of max_size
    allocations = lines["distributed/device_communicators/custom_all_reduce.py:106-119"]
    assert allocations.count("max_size") == 3
    assert memory.CUSTOM_ALL_REDUCE_GIB == pytest.approx(
        3 * int(max_car.group(1)) * int(max_car.group(2)) / memory.GIB)
    assert memory.CUSTOM_ALL_REDUCE_GIB < memory.NCCL_AND_ALL_REDUCE_GIB
    # graphs pause only with the env var; breakable graphs refuse it; pausable graphs are backed up
    assert 'SGLANG_MEMORY_SAVER_CUDA_GRAPH' in lines[
        "model_executor/runner_backend/full_cuda_graph_backend.py:121-124"]
    assert "not compatible with memory saver" in lines[
        "model_executor/runner_backend/breakable_cuda_graph_backend.py:84-94"]
    assert "enable_cpu_backup=True" in lines[
        "model_executor/runner_backend/full_cuda_graph_backend.py:185-193"]
    # the named buffers' clone stays on the GPU until resume
    assert "buffer.detach().clone()" in lines["managers/scheduler_components/weight_updater.py:478-483"]
    assert "del self.stashed_model_static_state" in lines[
        "managers/scheduler_components/weight_updater.py:396-403"]
    assert memory.named_buffer_clone_gib(RTX) == pytest.approx(262_144 * 64 * 4 / memory.GIB)
    # activations are not leftovers: releasing the KV cache flushes with empty_cache
    assert "self.flush_cache()" in lines["managers/scheduler_components/weight_updater.py:365-366"]
    assert "empty_cache: bool = True" in lines["managers/scheduler.py:5518"]
    assert "activations" not in " ".join(memory.released_leftovers_gib(RTX))
    # the draft worker's weights are backed up by --enable-weights-cpu-backup too
    assert "enable_weights_cpu_backup or" in lines[
        "model_executor/model_runner_components/load_model_utils.py:307-309"]
    # the second server measures after the gate: the first one's release is seen
    gate = lines["distributed/bootstrap.py:193-223"]
    assert gate.index("maybe_wait_for_gated_launch") < gate.index("pre_model_load_memory = ")
    assert memory.RUNTIME_OVERHEAD_GIB == RTX.runtime_overhead_gib
    assert memory.START_OVERHEAD_GIB == RTX.start_overhead_gib


def test_every_source_line_is_cited_by_the_sizing_code():
    code = (ROOT / "gateway" / "sim" / "memory.py").read_text()
    for ref in source_excerpts():
        path, lines = ref.split(":")
        name = path.rsplit("/", 1)[-1]
        assert f"{name}:" in code, ref
        assert any(f"{sep}{lines}" in code for sep in (":", " L", "(L", ", ")), ref


# SGLang 0.5.23's sglang/srt/, unpacked from its wheel (.ci/run does it; CONTRIBUTING.md).
SGLANG_SRT = os.environ.get("SGLANG_SRT", "")


@pytest.mark.skipif(not SGLANG_SRT or not Path(SGLANG_SRT).is_dir(),
                    reason="SGLang 0.5.23's source is not unpacked here: point SGLANG_SRT at an unpacked "
                           "sglang/srt (.ci/run does this; CONTRIBUTING.md)")
def test_source_excerpts_are_sglang_0_5_23():
    for ref, text in source_excerpts().items():
        path, lines = ref.split(":")
        first, _, last = lines.partition("-")
        source = (Path(SGLANG_SRT) / path).read_text().splitlines()
        assert "\n".join(source[int(first) - 1:int(last or first)]) + "\n" == text, ref
