"""Rank 0's side of tensor parallelism: start the node's workers, join them, and run each step on every rank.

    tp = TensorParallel.start(config, path, dtype, device)   # spawns ranks 1.. of node 0, loads shard 0
    budget = tp.agree_budget(budget)                          # the smallest rank's
    ... build the scheduler and the pool from per-rank sizes ...
    runner = tp.attach(ModelRunner(tp.model, store, device), pool)
    runner.execute(plan)                                      # every rank executes; rank 0's logits are whole
    tp.close()                                                # workers stop; idempotent, also at exit

The scheduler, the memory manager and the sampler exist on rank 0 only; a worker holds its shard and its own
caches (its heads' K/V pages and GDN slots, laid out by the same Pool, so page and slot ids mean the same on
every rank) and nothing else.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time
import weakref

import torch

from ..config import ModelConfig
from ..errors import ConfigError
from .group import Group, Rendezvous, TensorParallelError, join, open_store
from .model import describe
from .sharding import check_divisible
from .worker import STOP, load_shard, rank_budget, rank_threads, spawned_main

log = logging.getLogger("deltaserve.parallel")


class TensorParallel:
    """Rank 0's handle on the group: the worker processes it started, the Group, shard 0 (`model`)."""

    def __init__(self, cfg, rdv: Rendezvous, group: Group, procs: list, model):
        self.cfg, self.rdv, self.group, self.procs, self.model = cfg, rdv, group, procs, model
        self.broken: str | None = None  # why the group cannot run another step
        self._finalizer = weakref.finalize(self, _stop, group, procs)

    @classmethod
    def start(cls, cfg, path: str, dtype: str, device: torch.device) -> "TensorParallel":
        mc = ModelConfig.from_path(path)
        check_divisible(mc, cfg.tensor_parallel_size)  # before any process starts
        rdv = Rendezvous.from_config(cfg, device)
        if cfg.node_rank != 0:
            raise ConfigError(f"--node-rank {cfg.node_rank}: node 0 runs the engine; start the ranks of this node "
                              f"with `python -m deltaserve.parallel.worker` and the same flags")
        if device.type == "cpu":
            torch.set_num_threads(rank_threads(cfg, rdv))
        else:
            torch.cuda.set_device(rdv.device("cuda", 0))
        store = open_store(rdv, 0)
        rdv = dataclasses.replace(rdv, port=store.port)
        ctx = mp.get_context("spawn")
        level = logging.getLogger("deltaserve").getEffectiveLevel()
        procs = [ctx.Process(target=spawned_main, args=(cfg, path, dtype, rdv, r, os.getpid(), level), daemon=True,
                             name=f"deltaserve-tp-rank{r}") for r in range(1, rdv.local_world)]
        for p in procs:
            p.start()
        log.info("tensor parallel %d: %d rank(s) on this node (pids %s), %d node(s), meeting at %s:%d (%s)",
                 rdv.world, rdv.local_world, [p.pid for p in procs], rdv.nnodes, rdv.addr, rdv.port, rdv.backend)
        group = None
        try:
            group = join(rdv, 0, rdv.device(device.type, 0), store=store, alive=lambda: _check_alive(procs))
            model = load_shard(path, dtype, rdv.device(device.type, 0), rdv.world, 0, group)
        except BaseException as e:
            err = _diagnose(e, group, procs, rdv) if group is not None and not isinstance(e, ConfigError) else e
            _stop(group, procs)
            raise err from e
        log.info("%s", describe(mc, rdv.world))
        return cls(cfg, rdv, group, procs, model)

    # ---- start-up, after the shard is loaded ----
    def agree_budget(self, budget: int) -> int:
        """The cache budget every rank can afford: this rank's (rank_budget unless --kv-cache-memory gave it),
        the smallest over ranks."""
        mine = budget if self.cfg.kv_cache_memory else rank_budget(self.cfg, self.group.device, self.model, self.rdv)
        return self._guard(lambda: self.group.agree(mine))

    def attach(self, runner, pool) -> "ParallelRunner":
        """Send the Pool (every rank lays its caches out by it); returns the runner the engine steps."""
        self._guard(lambda: self.group.send(pool))
        self._guard(self.group.ready)  # every rank's caches are there
        return ParallelRunner(runner, self)

    # ---- failure handling ----
    def _guard(self, fn):
        if self.broken:
            raise TensorParallelError(self.broken)
        _check_alive(self.procs)
        try:
            return fn()
        except TensorParallelError as e:
            self.broken = str(e)
            raise
        except RuntimeError as e:  # a collective failed: a peer died, hung, or its socket broke
            self.fail(e)

    def fail(self, e: BaseException):
        """A collective inside the step failed: the group is down; raise what became of which rank."""
        err = _diagnose(e, self.group, self.procs, self.rdv)
        self.broken = str(err)
        raise err from e

    def close(self) -> None:
        """Stop the workers (they exit when told, or are terminated), free the groups. Idempotent."""
        self._finalizer()


class ParallelRunner:
    """The engine's runner under tensor parallelism: the plan goes to every rank, each executes it with its own
    ModelRunner (rank 0's is `local`), then one status exchange says whether any rank failed."""

    def __init__(self, local, tp: TensorParallel):
        self.local, self.tp = local, tp

    def __getattr__(self, name):  # build_batch, store, model, ...: rank 0's runner's
        return getattr(self.local, name)

    def execute(self, plan):
        g = self.tp.group
        self.tp._guard(lambda: g.send(plan))
        out, error = None, None
        try:
            out = self.local.execute(plan)
        except TensorParallelError:
            raise
        except RuntimeError as e:
            if _is_collective_error(e) or any(p.exitcode is not None for p in self.tp.procs):
                self.tp.fail(e)
            error = e
        except Exception as e:  # noqa: BLE001 - the same check fails on every rank: recoverable, below
            error = e
        failed = self.tp._guard(lambda: g.agree(int(error is not None), torch.distributed.ReduceOp.MAX))
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("a tensor-parallel worker rank failed this step (its log has the traceback); the "
                               "step does not count")
        return out


def _is_collective_error(e: BaseException) -> bool:
    text = str(e)
    return "gloo" in text or "Connection closed" in text or "Timed out" in text or "NCCL" in text


def _check_alive(procs) -> None:
    dead = [p for p in procs if p.exitcode is not None]
    if dead:
        raise TensorParallelError("; ".join(f"tensor-parallel worker {p.name} (pid {p.pid}) exited with code "
                                            f"{p.exitcode}" for p in dead))


def _diagnose(e: BaseException, group: Group | None, procs, rdv: Rendezvous) -> TensorParallelError:
    """A collective failed: say which rank and why (it exited, it reported an error, or it did not answer)."""
    deadline = time.monotonic() + 2.0  # a rank that crashed may still be on its way out
    while time.monotonic() < deadline and not any(p.exitcode is not None for p in procs):
        time.sleep(0.05)
    parts = [f"tensor-parallel worker {p.name} (pid {p.pid}) exited with code {p.exitcode}"
             for p in procs if p.exitcode is not None]
    if group is not None:
        parts += [f"rank {r} failed: {text.strip().splitlines()[-1]}" for r, text in group.reported_errors().items()]
    if not parts:
        parts.append(f"a rank did not answer within --distributed-timeout {rdv.timeout:g} s, or its connection "
                     f"broke")
    return TensorParallelError("the tensor-parallel group is down, the engine cannot continue: " + "; ".join(parts)
                               + f" ({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def _stop(group: Group | None, procs) -> None:
    """Tell live workers to exit, give them a moment, terminate the rest, free the groups."""
    if group is not None and all(p.exitcode is None for p in procs):
        try:
            group.send(STOP)
        except Exception:  # noqa: BLE001 - a peer is gone; terminate below
            pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
            p.join(2.0)
        if p.exitcode is None:
            p.kill()
            p.join(1.0)
    if group is not None:
        group.shutdown()
