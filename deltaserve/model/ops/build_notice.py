"""Say so when a compiled extension is about to be built, not loaded: the first start on a machine (or of a new
checkout) compiles the C++ kernels for one to a few minutes, and a silent pause that long reads as a hang.

    with build_notice(name, sources, "the avx512bf16 CPU kernels"):
        ext = cpp_extension.load(name=name, sources=sources, ...)

Before the build it logs what is built and how long the same build took last time on this machine (recorded
in $DELTASERVE_HOME/kernel-builds.json, keyed by what is built, not by checkout); after it, how long it took.
A load from torch's extension cache says nothing.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

from ...home import home

log = logging.getLogger("deltaserve")


def _record_path() -> str:
    return os.path.join(home(), "kernel-builds.json")


def _records() -> dict:
    try:
        with open(_record_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def last_build_seconds(what: str) -> float | None:
    """How long building `what` took last time on this machine, or None if never recorded."""
    v = _records().get(what)
    return float(v) if isinstance(v, (int, float)) else None


def needs_build(name: str, sources: list[str]) -> bool:
    """torch's cache has no up-to-date library for extension `name` (missing, or older than a source)."""
    from torch.utils.cpp_extension import _get_build_directory

    lib = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    try:
        built = lib.stat().st_mtime
    except OSError:
        return True
    return any(Path(s).stat().st_mtime > built for s in sources)


@contextlib.contextmanager
def build_notice(name: str, sources: list[str], what: str):
    """Log a build of extension `name` (described as `what`) before and after it; nothing for a cache load."""
    try:
        building = needs_build(name, sources)
    except Exception:  # noqa: BLE001 - a notice never stops a load
        building = False
    if building:
        last = last_build_seconds(what)
        log.info("building %s (once per machine and checkout, kept in torch's extension cache)%s ...", what,
                 f"; it took {last:.0f} s last time" if last is not None else "; this takes one to a few minutes")
    t0 = time.perf_counter()
    yield
    if building:
        took = time.perf_counter() - t0
        log.info("built %s in %.0f s", what, took)
        records = _records()
        records[what] = round(took, 1)
        try:
            os.makedirs(home(), exist_ok=True)
            tmp = _record_path() + f".{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(records, f, indent=1, sort_keys=True)
            os.replace(tmp, _record_path())
        except OSError:
            pass
