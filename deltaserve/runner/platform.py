"""Start-up choices about the machine: device, allocator tuning, the default cache budget."""
from __future__ import annotations

import ctypes
import logging

import torch

from ..memory.resident import host_memory

log = logging.getLogger("deltaserve")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_tuned = False


def tune_allocator() -> None:
    """Keep glibc from mmapping (and unmapping) every allocation >= 32 MiB.

    Each fresh 4 KiB page faults at ~3 us on this machine kind, so large prefill temporaries
    cost 2-3x without this (docs/cpu.md). Idempotent; a no-op off glibc.
    """
    global _tuned
    if _tuned:
        return
    _tuned = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    except (OSError, AttributeError):
        pass


def select_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def available_bytes(device: torch.device) -> int:
    """Memory free for this process now: the device's, or the machine's MemAvailable on a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return host_memory()[1] or 4 << 30


def default_kv_budget(device: torch.device, utilization: float, model: torch.nn.Module) -> int:
    """--memory-utilization of the memory still free after loading the weights (capped at 2 GiB on CPU,
    where the pool is zeroed page by page and shares RAM with everything else)."""
    budget = int(available_bytes(device) * utilization)
    if device.type == "cpu":
        budget = min(budget, 2 << 30)
    return budget
