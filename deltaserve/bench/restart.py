"""`deltaserve bench restart`: a session's next turn after the server restarted, served from the prefix cache's
disk tier, against the same turn cold; side by side in one run.

    deltaserve bench restart --preset qwen3.5-0.8b-shape --context 32768

One session: turn 1 is --context prompt tokens (seeded random ids) and --output-tokens generated; its engine runs
with --cache-disk DIR (a fresh directory) and is closed, which ends its writes. A second engine opens the same
DIR, as a restarted server does, and serves turn 2: turn 1's prompt, its answer and --new-tokens more. A third
engine without the disk tier serves turn 2 cold. Each engine runs in a process of its own (nothing of the one
before is left in memory), and before the restarted one starts the records are flushed and dropped from the page
cache (posix_fadvise DONTNEED): a cold restart, whose reads come from the disk; the share of the records still
cached when it starts is printed (--warm-restart keeps them cached, as a restart right after a stop would find them). Greedy with logprobs: the restarted turn must equal its cold
twin bit for bit (tokens and logprobs), which the report checks.

Reported: turn 1's TTFT (cold); turn 2 after the restart: prompt tokens, cached tokens and their share of turn 1's
prompt, the tokens that came from disk, the reads and their mean latency, TTFT; turn 2 cold: TTFT; the ratio cold
/ restarted and the targets (>= 95% of the previous prompt cached, TTFT <= 1/5 of cold).
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing
import os
import random
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor

from ..config import ENGINE_DEFAULTS, add_engine_args, engine_args
from ..engine.sampling_params import SamplingParams
from .progress import progress_for
from .serve import in_process

_say = progress_for("restart")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve bench restart", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--context", type=int, default=32768, help="turn 1's prompt tokens")
    p.add_argument("--new-tokens", type=int, default=512, help="turn 2's tokens after turn 1's answer")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="the prompt's random ids")
    p.add_argument("--dir", default=None, help="the disk tier's directory (default: a fresh temporary one)")
    p.add_argument("--warm-restart", action="store_true",
                   help="leave the records in the page cache for the restarted process (default: dropped)")
    add_engine_args(p, ("preset", "model", "kv_cache_memory", "max_num_batched_tokens", "cache_layout",
                        "checkpoint_grid", "num_threads", "cache_disk_bytes"))
    return p


def _serve_here(flags: dict, prompt: list[int], params: SamplingParams) -> dict:
    """One request on a fresh engine, closed after it (which ends its disk writes): what the report reads of it."""
    llm = in_process(flags)
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        s = llm.engine.stats()
        c = out.outputs[0]
        return {"tokens": list(c.token_ids), "cached": out.num_cached_tokens,
                "ttft": out.metrics.first_token_time - out.metrics.arrival_time,
                "signature": (tuple(c.token_ids),
                              tuple(tuple(sorted((t, lp.logprob) for t, lp in pos.items())) for pos in c.logprobs)),
                "disk_hit_tokens": s.disk_hit_tokens, "disk_reads": s.disk_reads,
                "disk_read_seconds": s.disk_read_seconds}
    finally:
        llm.close()


def _serve(flags: dict, prompt: list[int], params: SamplingParams) -> dict:
    """_serve_here in a process of its own (spawned: nothing of this one's torch or caches is shared)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(_serve_here, flags, prompt, params).result()


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def page_cached_share(directory: str) -> float:
    """The share of the bytes of the files in directory that sit in the page cache (mincore over a mapping)."""
    page = os.sysconf("SC_PAGE_SIZE")
    libc = _libc()
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    cached = total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            if size == 0:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    raise OSError(ctypes.get_errno(), f"mmap of {path}")
                try:
                    pages = (size + page - 1) // page
                    vec = ctypes.create_string_buffer(pages)
                    if libc.mincore(addr, size, vec) != 0:
                        raise OSError(ctypes.get_errno(), f"mincore of {path}")
                    cached += sum(b & 1 for b in vec.raw) * page
                    total += pages * page
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
    return cached / total if total else 0.0


def drop_page_cache(directory: str) -> None:
    """Flush the files in directory and ask the kernel to drop their pages from its cache."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    flags = engine_args(a)
    vocab = 3000  # ids well inside every preset's vocabulary, clear of the special tokens
    rng = random.Random(a.seed)
    p1 = [rng.randrange(10, vocab) for _ in range(a.context)]
    params = SamplingParams(temperature=0.0, max_tokens=a.output_tokens, ignore_eos=True, logprobs=5)
    directory = a.dir or tempfile.mkdtemp(prefix="deltaserve-restart-")
    shutil.rmtree(directory, ignore_errors=True)
    disk = flags | {"cache_disk": directory}
    try:
        _say(f"turn 1: {a.context} tokens cold, tier {directory}")
        t1 = _serve(disk, p1, params)
        p2 = p1 + t1["tokens"] + [rng.randrange(10, vocab) for _ in range(a.new_tokens)]
        if not a.warm_restart:
            drop_page_cache(directory)
        in_cache = page_cached_share(directory)
        _say(f"turn 2 after a restart: {len(p2)} tokens, {100 * in_cache:.0f}% of the records in the page cache")
        hit = _serve(disk, p2, params)
        _say("turn 2 cold")
        cold = _serve(flags, p2, params)
    finally:
        if a.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    share = hit["cached"] / len(p1)
    ratio = cold["ttft"] / hit["ttft"]
    same = hit["signature"] == cold["signature"]
    mean_read = hit["disk_read_seconds"] / hit["disk_reads"] * 1e3 if hit["disk_reads"] else 0.0
    print(f"model {flags.get('preset', ENGINE_DEFAULTS['preset']) if 'model' not in flags else flags['model']}, "
          f"layout {flags.get('cache_layout', ENGINE_DEFAULTS['cache_layout'])}; each turn in its own process; "
          f"{'a warm' if a.warm_restart else 'a cold'} restart: {100 * in_cache:.0f}% of the records' bytes in the "
          "page cache when the restarted process started")
    print("| | prompt | cached | from disk | TTFT s |")
    print("|---|---|---|---|---|")
    print(f"| turn 1, cold | {len(p1)} | 0 | - | {t1['ttft']:.2f} |")
    print(f"| turn 2 after a restart | {len(p2)} | {hit['cached']} ({100 * share:.1f}% of turn 1's prompt) | "
          f"{hit['disk_hit_tokens']} tokens, {hit['disk_reads']} reads, {mean_read:.1f} ms mean | {hit['ttft']:.2f} |")
    print(f"| turn 2, cold | {len(p2)} | {cold['cached']} | - | {cold['ttft']:.2f} |")
    print(f"cold / restarted TTFT {ratio:.1f}x (target >= 5x: {'met' if ratio >= 5 else 'missed'}); cached "
          f"{100 * share:.1f}% of the previous prompt (target >= 95%: {'met' if share >= 0.95 else 'missed'}); "
          f"restarted == cold, tokens and logprobs: {'bit-identical' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
