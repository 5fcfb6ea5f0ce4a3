"""Where the GPUs are visible to the gateway (it runs beside the pair): how much of each
GPU's memory is free, from NVML. Without pynvml or a GPU: None, and the check is skipped."""

from __future__ import annotations

from typing import Any


def free_fractions() -> list[float] | None:
    """Free memory / total, per visible GPU; None when NVML cannot tell."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    nvml: Any = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return None
    try:
        fractions = []
        for index in range(nvml.nvmlDeviceGetCount()):
            info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
            fractions.append(info.free / info.total if info.total else 0.0)
        return fractions or None
    except nvml.NVMLError:
        return None
    finally:
        nvml.nvmlShutdown()
