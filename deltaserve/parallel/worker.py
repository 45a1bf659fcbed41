"""What every rank runs: load its shard, agree on the pool, then carry out rank 0's plans.

    rank 0 (the engine)                         rank r > 0 (a worker process)
    join the group, load shard 0                join the group, load shard r
    budget = min over ranks  <-- all-reduce --> budget
    build the scheduler and the pool (per rank)
    send the Pool            --- store   --->   CacheStore(the rank's geometry, the same Pool)
    each step: send the plan --- store   --->   receive the plan
               execute (the forward's all-reduces and the head's all-gather, on compute)
               status: any rank failed? <-- all-reduce --> status
               sample (rank 0 only)
    close: send None         --- store   --->   exit 0

Every rank executes the same StepPlan with the same ModelRunner, so they issue the same collectives in the same
order. A step that raises on every rank at the same point (a fail-closed check: the plan is the same
everywhere) reaches the status exchange on every rank; rank 0 raises it to the engine, which recovers as it does
alone, and the workers wait for the next plan. A rank that fails alone reports it through the status; one that
dies or hangs breaks a collective, and rank 0 raises TensorParallelError (group.py).

Run a node other than node 0 of a multi-machine engine with
`python -m deltaserve.parallel.worker --tensor-parallel-size N --nnodes M --node-rank K --master-addr HOST
--master-port PORT [--model DIR ...]` (the same engine flags as node 0's).
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback

import torch

from ..config import EngineConfig, ModelConfig, add_engine_args, engine_args, resolve_dtype
from ..embedded.model import ensure_model
from ..model.loader import load_model
from ..model.ops.cpu_kernels import use_isa
from ..runner.cache import CacheStore
from ..runner.platform import default_kv_budget, select_device
from ..runner.runner import ModelRunner
from .group import Group, Rendezvous, join
from .model import build_sharded

log = logging.getLogger("deltaserve.parallel")

STOP = None  # the plan that ends a worker


def load_shard(path: str, dtype: str, device: torch.device, tp: int, rank: int, group: Group):
    """This rank's ShardedModel: the model loaded whole on the CPU (strict, as load_model checks it),
    sliced (sharding.py), moved to device, connected to the group, its kernels chosen and bf16 weights packed."""

    # a block-FP8 model is sharded as its dequantized weights (docs/fp8.md): fp8 weights are not sharded yet
    full = load_model(path, dtype=dtype, device="cpu", prepack=False, dequantize=True, vision=False)
    # the ranks serve text: a multimodal checkpoint's vision encoder (visual.*) is not sharded (docs/images.md)
    sd = {k: v for k, v in full.state_dict().items() if not k.startswith("visual.")}
    model = build_sharded(sd, full.config, full.dtype, tp, rank, device)
    del full
    model.connect(group)
    model.select_decode_kernels()
    model.prepack_linears()
    return model


def rank_threads(cfg, rdv: Rendezvous) -> int:
    """torch threads of one rank: --num-threads, else this machine's cores shared by its ranks."""
    return cfg.num_threads or max(1, (os.cpu_count() or 1) // rdv.local_world)


def rank_budget(cfg, device: torch.device, model, rdv: Rendezvous) -> int:
    """This rank's cache budget: --kv-cache-memory (per rank), else --memory-utilization of its device's free
    memory (on a CPU, whose memory the node's ranks share, divided among them)."""

    if cfg.kv_cache_memory:
        return cfg.kv_cache_memory
    budget = default_kv_budget(device, cfg.memory_utilization, model)
    return budget // rdv.local_world if device.type == "cpu" else budget


def serve_rank(cfg, path: str, dtype: str, rdv: Rendezvous, rank: int) -> None:
    """A worker rank, start to end: join, load, agree on the budget, receive the Pool, then execute plans until
    rank 0 sends STOP (returns) or goes away (raises)."""

    device = rdv.device("cuda" if rdv.backend == "nccl" else "cpu", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(rank_threads(cfg, rdv))
    group = join(rdv, rank, device)
    try:
        model = load_shard(path, dtype, device, rdv.world, rank, group)
        group.agree(rank_budget(cfg, device, model, rdv))
        pool = group.recv()
        if pool is STOP:  # rank 0 failed to start after loading
            return
        tdtype = getattr(torch, dtype)
        runner = ModelRunner(model, CacheStore(model.config, pool, kv_dtype=tdtype, conv_dtype=tdtype, device=device),
                             device)
        group.ready()
        log.info("rank %d ready: %d pages of %d tokens, %d slots", rank, pool.num_pages, pool.block_size,
                 pool.num_slots)
        while True:
            plan = group.recv()
            if plan is STOP:
                return
            failed = 0
            try:
                runner.execute(plan)
            except Exception:  # noqa: BLE001 - reported through the status; rank 0 decides
                log.error("rank %d: step failed\n%s", rank, traceback.format_exc())
                failed = 1
            group.agree(failed, torch.distributed.ReduceOp.MAX)
    except BaseException:
        group.report_error(f"rank {rank} (pid {os.getpid()}): {traceback.format_exc()}")
        raise
    finally:
        group.shutdown()


def _watch_parent(parent: int) -> None:
    """A spawned worker ends when the engine process that started it is gone (killed before it could say so)."""

    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


def spawned_main(cfg, path: str, dtype: str, rdv: Rendezvous, rank: int, parent: int,
                 log_level: int = logging.WARNING) -> None:
    """The entry of a worker process the engine spawned (multiprocessing, spawn context); log_level: the
    engine's (its own log lines then carry the rank)."""

    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the engine's to handle: it stops us
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    serve_rank(cfg, path, dtype, rdv, rank)


def main(argv: list[str] | None = None) -> int:
    """A node other than 0: every rank of this node as a process, until node 0's engine ends."""

    
    ap = argparse.ArgumentParser(prog="python -m deltaserve.parallel.worker",
                                 description="the tensor-parallel ranks of one node other than node 0")
    add_engine_args(ap)
    cfg = EngineConfig.from_kwargs(**engine_args(ap.parse_args(argv)))
    if cfg.node_rank == 0:
        ap.error("node 0 runs the engine (deltaserve serve / generate with the same flags), not this command")
    logging.basicConfig(level=logging.INFO)
    if getattr(cfg, "cpu_isa", "auto") != "auto":  # node 0's ranks inherit its choice from the engine's process
        use_isa(cfg.cpu_isa)
    from ..hub import resolve_model
    path = resolve_model(cfg.model, cfg.revision) or ensure_model(cfg.preset, seed=cfg.seed)  # Hub id: this node's cache
    dtype = resolve_dtype(cfg.dtype, ModelConfig.from_path(path))
    rdv = Rendezvous.from_config(cfg, select_device(cfg.device))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=spawned_main, args=(cfg, path, dtype, rdv, r, os.getpid(), logging.INFO),
                         daemon=True) for r in range(rdv.first_rank, rdv.first_rank + rdv.local_world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(abs(p.exitcode or 0) for p in procs)


if __name__ == "__main__":
    raise SystemExit(main())
