"""The benchmarks' checkpoints and what their deltaserve arms will hold, settled before any arm loads.

made_apart: a preset's checkpoint (bf16, or block-FP8) found or made in a child process, so the benchmark's own
process never holds a model's tensors on their way to disk (nor the heap they leave behind).
check_arms_fit: the arms' weights as run, pools and the runtime (memory/resident.py) against the memory the
machine has available; ArmsDoNotFit names every figure before a byte of any arm is loaded.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from ..config import ModelConfig
from ..memory.resident import RUNTIME_BYTES, largest_tensor, weights_as_run

_MAKE = ("import sys\nfrom deltaserve.embedded.model import ensure_model\n"
         "print(ensure_model(sys.argv[1], quantize=sys.argv[2] or None))")


def made_apart(preset: str, quantize: str | None = None) -> str:
    """ensure_model(preset, quantize=quantize) run in a child process: the checkpoint's directory."""
    r = subprocess.run([sys.executable, "-c", _MAKE, preset, quantize or ""], capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"making the {preset}{' ' + quantize if quantize else ''} checkpoint failed: "
                           f"{(r.stderr or r.stdout).strip()[-2000:]}")
    return r.stdout.strip().splitlines()[-1]


class ArmsDoNotFit(RuntimeError):
    def __init__(self, figures: str):
        super().__init__(f"{figures}: run fewer arms (--cpu-isas, --fp8, --fp8-head, --speculative) or give a "
                         "smaller --kv-cache-memory")
        self.figures = figures  # the figures alone, without the advice


@dataclass(frozen=True)
class ArmMemory:
    """One deltaserve arm's own engine: its weights as run and its pool."""

    name: str
    weights: int
    pool: int
    loading: int = 0  # the largest tensor its load reads: what loading may leave in the process's heap


def arm_memory(name: str, model_dir: str, pool: int, *, mtp: bool = False, quantize_head: str = "none",
               quantize: str = "none") -> ArmMemory:
    """The arm's figures for a bf16 engine with images off (how bench throughput starts its arms)."""
    m = ModelConfig.from_path(model_dir)
    weights = weights_as_run(model_dir, m, "bfloat16", images=False, mtp=mtp, quantize_head=quantize_head,
                             quantize=quantize) or 0
    return ArmMemory(name, weights, pool, largest_tensor(model_dir, m, images=False, mtp=mtp,
                                                         quantize_head=quantize_head))


def check_arms_fit(arms: list[ArmMemory], available: int) -> str:
    """The arms' figures as one line; ArmsDoNotFit (the same figures) where their weights, pools, the largest
    tensor each one's loading reads and one runtime add up to more than `available` bytes."""
    # each arm's loading may leave up to its largest tensor in the heap the arms share (three 4B-shape arms in one
    # process reached 24.3 GB resident, the OOM killer's figure, against 21.1 GB of weights, pools and runtime)
    total = sum(a.weights + a.pool + a.loading for a in arms) + RUNTIME_BYTES
    parts = [f"{a.name} {a.weights / 1e9:.2f} GB weights + {a.pool / 1e9:.2f} GB pool"
             + (f" + {a.loading / 1e9:.2f} GB loading" if a.loading else "") for a in arms]
    line = f"{'; '.join(parts)}; runtime {RUNTIME_BYTES / 1e9:.2f} GB: {total / 1e9:.2f} GB in all"
    if total > available:
        raise ArmsDoNotFit(f"the deltaserve arms do not fit together ({line}), and this machine has "
                           f"{available / 1e9:.2f} GB available")
    return line
