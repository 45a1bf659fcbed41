"""The process group of a tensor-parallel engine: rendezvous, collectives, rank 0's messages, failure reports.

Ranks meet as torchrun's do: a TCPStore on node 0 (`--master-addr`, `--master-port`; on one machine a free port
the engine picks), `--nnodes` machines of tensor_parallel_size / nnodes ranks each, ranks numbered node by node.
The process group is an object of its own (not torch.distributed's global default group), so an engine can be
started, shut down and started again in one process, and nothing global is left behind.

- The collectives (the forward's all-reduces, the head's all-gather, the start-up agreement, the end-of-step
  status) run on one process group: gloo on CPU, nccl on CUDA, with --distributed-timeout. A rank that dies
  breaks its peers' sockets at once; one that hangs makes them raise when the timeout passes. Either way rank
  0 raises TensorParallelError.
- Rank 0's messages (the Pool at start-up, then each step's plan, pickled: torch-free data) go through the
  store as numbered keys `msg/<n>`: a set never waits for a worker (a hung worker cannot stall rank 0 before
  the collectives' timeout catches it), and a worker waits for the next key as long as the engine idles (a
  server with no requests sends nothing); a worker whose rank 0 is gone sees the store's socket close and exits.
  Rank 0 deletes a message once a collective after it shows that every rank has read it.

A rank that fails writes its traceback into the store under `error/<rank>`, where rank 0 reads it back.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError

IDLE_WAIT = timedelta(hours=1)  # a worker's wait for the next message, renewed while the engine idles
START_TIMEOUT = 120.0  # seconds the ranks have to meet (at least; more when --distributed-timeout is longer)


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank died, hung past --distributed-timeout, or failed to start).
    The engine cannot go on; the message names the rank and what became of it."""

    fatal = True  # LLMEngine.step re-raises it instead of recovering the step

@dataclass(frozen=True)
class Rendezvous:
    """Where and how the ranks meet. Ranks of node n: n * local_world .. (n + 1) * local_world - 1."""

    world: int
    nnodes: int
    node_rank: int
    addr: str
    port: int  # 0 on rank 0 of a one-machine engine: its store picks a free port (then set by the store)
    timeout: float  # seconds
    backend: str  # "gloo" | "nccl"

    @property
    def start_timeout(self) -> float:
        return max(self.timeout, START_TIMEOUT)

    @property
    def local_world(self) -> int:
        return self.world // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.local_world

    @classmethod
    def from_config(cls, cfg, device: torch.device) -> "Rendezvous":
        tp = cfg.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < tp // cfg.nnodes:
            raise ConfigError(f"--tensor-parallel-size {tp} over {cfg.nnodes} node(s) needs {tp // cfg.nnodes} "
                              f"CUDA devices per node; this one has {torch.cuda.device_count()}")
        return cls(world=tp, nnodes=cfg.nnodes, node_rank=cfg.node_rank, addr=cfg.master_addr,
                   port=cfg.master_port or 0, timeout=cfg.distributed_timeout,
                   backend="nccl" if device.type == "cuda" else "gloo")

    def device(self, kind: str, rank: int) -> torch.device:
        """The device of `rank` on its node (CUDA: one device per local rank)."""
        return torch.device("cuda", rank - self.first_rank) if kind == "cuda" else torch.device("cpu")


class Group:
    """One rank's view of the group: rank, world, the process group of the collectives, the store."""

    def __init__(self, rdv: Rendezvous, rank: int, store, device: torch.device):
        self.rdv, self.rank, self.world, self.store, self.device = rdv, rank, rdv.world, store, device
        start = timedelta(seconds=rdv.start_timeout)  # building the group is a rendezvous of its own
        if rdv.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = start
            self.compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute/", store), rank, self.world, opts)
        else:
            self.compute = dist.ProcessGroupGloo(dist.PrefixStore("compute/", store), rank, self.world, start)
        self._next = 0  # the number of the next message sent (rank 0) or expected (the others)
        self._kept = 0  # rank 0: the messages below this one are deleted

    def ready(self) -> None:
        """Every rank has loaded its shard and laid out its caches: a last start-up collective, then the steps'
        timeout (--distributed-timeout) instead of the start-up one."""
        self.agree(1)
        self.compute.set_timeout(timedelta(seconds=self.rdv.timeout))

    # ---- collectives ----
    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place; t must be contiguous. Returns t."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.compute.allreduce([t], opts).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world)]
        self.compute.allgather([out], [t]).wait()
        return out

    def agree(self, value: int, op=dist.ReduceOp.MIN) -> int:
        """An int every rank contributes to (min / max / sum over ranks), known to all."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, op).item())

    # ---- rank 0's messages ----
    def send(self, obj) -> None:
        """Rank 0: the next message (pickled). A step's collectives come between any two plans, so when message n
        goes every rank has read message n - 2 and those before it: their keys are deleted."""
        assert self.rank == 0, "only rank 0 sends"
        n = self._next
        for k in range(self._kept, n - 1):
            self.store.delete_key(f"msg/{k}")
        self._kept = max(self._kept, n - 1)
        self.store.set(f"msg/{n}", pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        self._next = n + 1

    def recv(self):
        """A worker: rank 0's next message; waits as long as it takes, raises when rank 0's store is gone."""
        key = f"msg/{self._next}"
        while True:
            try:
                self.store.wait([key], IDLE_WAIT)
                break
            except dist.DistStoreError:  # the wait timed out (rank 0 idles); a closed socket raises another error
                continue
        self._next += 1
        return pickle.loads(self.store.get(key))

    # ---- failure reports ----
    def report_error(self, text: str) -> None:
        try:
            self.store.set(f"error/{self.rank}", text[-4000:])
        except Exception:  # noqa: BLE001 - the store (rank 0) may be gone already
            pass

    def reported_errors(self) -> dict[int, str]:
        out = {}
        for r in range(self.world):
            try:
                if r != self.rank and self.store.check([f"error/{r}"]):
                    out[r] = self.store.get(f"error/{r}").decode(errors="replace")
            except Exception:  # noqa: BLE001
                break
        return out

    def shutdown(self) -> None:
        try:
            self.compute.abort()
        except Exception:  # noqa: BLE001 - best effort: the peers may be gone
            pass


def open_store(rdv: Rendezvous, rank: int):
    """Rank 0 hosts the TCPStore (on rdv.port, or a free one when 0); the others connect to it."""
    return dist.TCPStore(rdv.addr, rdv.port, world_size=rdv.world, is_master=rank == 0,
                         timeout=timedelta(seconds=rdv.start_timeout), wait_for_workers=False)


def wait_for_ranks(store, rdv: Rendezvous, alive) -> None:
    """Rank 0: wait until every rank has checked in (`joined/<rank>`), at most rdv.start_timeout s; alive() raises
    TensorParallelError as soon as a local worker process has died (so a worker that fails to start is reported
    at once, not after the timeout)."""
    deadline = time.monotonic() + rdv.start_timeout
    keys = [f"joined/{r}" for r in range(1, rdv.world)]
    while True:
        alive()
        if not keys or store.check(keys):
            return
        if time.monotonic() > deadline:
            missing = [k.split("/")[1] for k in keys if not store.check([k])]
            raise TensorParallelError(f"rank(s) {', '.join(missing)} did not join within {rdv.start_timeout:g} s "
                                      f"at {rdv.addr}:{store.port}")
        time.sleep(0.02)


def join(rdv: Rendezvous, rank: int, device: torch.device, store=None, alive=None) -> Group:
    """This rank's Group: opens (rank 0: hosts) the store, checks in, and builds the process groups once every
    rank is there (building them is itself a rendezvous through the store)."""
    store = store or open_store(rdv, rank)
    if rank == 0:
        wait_for_ranks(store, rdv, alive or (lambda: None))
    else:
        store.set(f"joined/{rank}", "1")
    return Group(rdv, rank, store, device)
