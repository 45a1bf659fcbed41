"""What a bundle records of the machine it was measured on: the CPU's name and the load around the run. No torch."""
from __future__ import annotations

import os
import platform


def load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
