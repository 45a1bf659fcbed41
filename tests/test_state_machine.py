"""A CPU state-machine test of the checkpoint bookkeeping (the kind vllm-gaudi's in-page fix shipped).

The REAL Scheduler and MemoryManager are driven by a toy executor that carries out their StepPlans on toy
storage whose contents are checkable functions of the tokens:

  * a slot's "GDN state" is one hash chain per GDN group: state' = H(state, token, group); zero = 0;
  * an attention page holds one row per position: the token id written there (0 = zeroed);
  * in-page checkpoints live in the pool's own pages (row 0 of page location[g] holds group g's state,
    the other rows are padding); runs checkpoints span k pages per group (row 0 of each of the k pages
    holds the state; a restore that finds them unequal reads garbage); per-block checkpoints live in a
    separate per-page state store;
  * freed pages and slots are filled with a sticky NaN-like sentinel (H(NaN, ...) = NaN), so a missing
    zero, restore or save reads garbage;
  * the toy "attention" reads every row of the page holding the last token (masked rows included: a mask
    does not cancel a NaN), and the sampled token is a function of the states and of that page.

Before each step the harness checks, for every scheduled sequence, that its slot holds the chain of its
tokens [0, start_pos) and its page rows [0, start_pos) hold its tokens (a "state check"); every sampled
token is checked against the token an exact model would produce. The workload is agent-like (multi-turn
sessions that extend their earlier prompts, shared system prompts, salts), on a pool small enough to
force preemption, with random aborts (also between schedule() and update()) and engine-side stops.
Mutants (no save, no restore, no slot hand-back, no zeroing of new pages or slots) must each fail.

With a disk tier (memory/disk_tier.py), a toy disk does what runner/disk_store.py does, between schedule() and the
step: evicted pages' contents are copied out before the planted garbage or the step can touch them, reads
complete (a few fail, as a corrupt record does: a miss), and loaded contents land in the pages the manager took.
A restored block that is not bit for bit what was spilled fails the state checks.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from deltaserve.memory import CheckpointError, MemoryManager
from deltaserve.memory.eviction import ValueEviction
from deltaserve.scheduler import Request, Scheduler, StepPlan

NAN = -1  # sticky garbage
MASK = (1 << 61) - 1
VOCAB = 48
STOP_TOKEN = 7  # the "engine" stops a request when it samples this


def H(state: int, token: int, g: int) -> int:
    if state == NAN:
        return NAN
    return hash((state, token, g)) & MASK


class Stall(RuntimeError):
    pass


class Mismatch(AssertionError):
    pass


class ToyDisk:
    """The I/O worker and the byte copies of runner/disk_store.py, on toy storage, completing reads at once."""

    def __init__(self, ex: "ToyExecutor", tier, rng: random.Random, mutant: str | None):
        self.ex, self.tier, self.rng, self.mutant = ex, tier, rng, mutant
        self.files: dict = {}
        self.staged: dict = {}
        self.loads = 0

    def _copy_out(self, kind, loc):
        ex = self.ex
        if kind == "kv":
            return list(ex.kv[loc[0]])
        return [list(ex.kv[q]) for q in loc] if ex.pooled else ex.block_state[loc[0]]

    def _copy_in(self, kind, loc, data) -> None:
        ex = self.ex
        if self.mutant == "disk_load_garbage" or data is None:  # None: a spill_late record read before its copy
            data = [NAN] * ex.bs if kind == "kv" else ([[NAN] * ex.bs] * len(loc) if ex.pooled else (NAN,) * ex.G)
        if kind == "kv":
            ex.kv[loc[0]] = list(data)
        elif ex.pooled:
            for q, rows in zip(loc, data):
                ex.kv[q] = list(rows)
        else:
            ex.block_state[loc[0]] = data

    def sync(self) -> None:
        ops, loads = self.tier.take()
        for op, arg in ops:
            if op == "write":
                if self.mutant != "disk_spill_late":
                    self.files[arg.record.key] = self._copy_out(arg.record.kind, arg.location)
                else:
                    self.files[arg.record.key] = None
                self.tier.done.append(("write", arg.record.key, True, 0.0, arg.record.nbytes))
            elif op == "read":
                ok = arg.key in self.files and self.rng.random() > 0.05  # a corrupt record now and then
                if ok:
                    self.staged[arg.key] = self.files[arg.key]
                self.tier.done.append(("read", arg.key, ok, 0.0, arg.nbytes))
            else:
                self.files.pop(arg, None)
        self._late = ops if self.mutant == "disk_spill_late" else []
        for ld in loads:  # a record loaded and then deleted in the same step still lands: its bytes are staged
            self._copy_in(ld.record.kind, ld.location, self.staged.pop(ld.record.key))
            self.loads += 1
        for key in [k for k in self.staged if k not in self.tier.staged and k not in self.tier.reading]:
            del self.staged[key]

    def after_step(self) -> None:
        """The disk_spill_late mutant copies spilled pages out after the step (too late: reused pages)."""
        for op, arg in self._late:
            if op == "write":
                self.files[arg.record.key] = self._copy_out(arg.record.kind, arg.location)
        self._late = []


class ToyExecutor:
    """Carries out StepPlans on toy storage, in the runner's order: zero, restore, check, forward, save."""

    def __init__(self, mem: MemoryManager, mutant: str | None):
        self.bs, self.G, self.pooled, self.k = mem.block_size, mem.num_gdn_groups, mem.layout.in_pool, mem.pages_per_state
        self.kv = [[NAN] * self.bs for _ in range(mem.num_pages)]  # uninitialised memory is garbage
        self.slots = [[NAN] * self.G for _ in range(mem.num_slots)]
        self.block_state = [(NAN,) * self.G for _ in range(mem.num_pages)]  # per-block layout only
        self.mutant = mutant

    def plant(self, pages, slots) -> None:
        for p in pages:
            self.kv[p] = [NAN] * self.bs
            self.block_state[p] = (NAN,) * self.G
        for s in slots:
            self.slots[s] = [NAN] * self.G

    def pre(self, plan: StepPlan) -> None:
        if self.mutant != "no_zero_pages":
            for p in plan.zero_pages:
                self.kv[p] = [0] * self.bs
                self.block_state[p] = (0,) * self.G
        if self.mutant != "no_zero_slots":
            for s in plan.zero_slots:
                self.slots[s] = [0] * self.G
        by_slot = {w.slot: w for w in plan.work}
        for c in plan.restores:  # the runner's fail-closed double check
            w = by_slot.get(c.slot)
            if w is None or w.start_pos % self.bs:
                raise CheckpointError("restore off a block boundary")
        for c in plan.saves:
            w = by_slot.get(c.slot)
            if w is None or c.pos % self.bs or not w.start_pos < c.pos <= w.start_pos + len(w.token_ids):
                raise CheckpointError("save after a partial block, or outside the slot's work")
        if self.mutant == "no_restore":
            return
        for c in plan.restores:
            if self.pooled:
                k = self.k
                pieces = [{self.kv[c.location[g * k + j]][0] for j in range(k)} for g in range(self.G)]
                self.slots[c.slot] = [p.pop() if len(p) == 1 else NAN for p in pieces]
            else:
                self.slots[c.slot] = list(self.block_state[c.location[0]])

    def forward(self, plan: StepPlan) -> dict[str, int]:
        """The work, token by token; each save takes the slot's state after exactly token pos - 1 (inside the
        chunk or at its end, as the runner's GDN layers and slot copy do)."""
        bs, out = self.bs, {}
        saves: dict[int, list] = {}
        for c in plan.saves:
            pos = c.pos + (self.bs if self.mutant == "save_a_block_late" else 0)
            saves.setdefault(c.slot, []).append((pos, c))
        for w in plan.work:
            st = self.slots[w.slot]
            due = saves.get(w.slot, [])
            for i, t in enumerate(w.token_ids):
                pos = w.start_pos + i
                self.kv[w.page_ids[pos // bs]][pos % bs] = t
                for g in range(self.G):
                    st[g] = H(st[g], t, g)
                for p, c in due:
                    if p == pos + 1 and self.mutant != "no_save":
                        self._save(c, st)
            if w.sample:
                end = w.start_pos + len(w.token_ids)
                out[w.request_id] = sample(st, self.kv[w.page_ids[(end - 1) // bs]])
        return out

    def _save(self, c, states) -> None:
        if self.pooled:
            for i, q in enumerate(c.location):
                self.kv[q][0] = states[i // self.k]
        else:
            self.block_state[c.location[0]] = tuple(states)


def sample(states, page_rows) -> int:
    if NAN in states or NAN in page_rows:
        return 1  # a NaN logit row: argmax lands on some fixed token
    return 1 + hash((tuple(states), tuple(page_rows))) % VOCAB


class Reference:
    """What an exact model computes for a token sequence: chained states, and the token it samples."""

    def __init__(self, G: int, bs: int):
        self.G, self.bs = G, bs
        self.memo: dict[str, list[tuple[int, ...]]] = {}

    def states(self, rid: str, tokens: list[int], n: int) -> tuple[int, ...]:
        chain = self.memo.setdefault(rid, [(0,) * self.G])
        while len(chain) <= n:
            t = tokens[len(chain) - 1]
            chain.append(tuple(H(s, t, g) for g, s in enumerate(chain[-1])))
        return chain[n]

    def next_token(self, rid: str, tokens: list[int], end: int) -> int:
        bs = self.bs
        first = (end - 1) // bs * bs
        rows = tokens[first:end] + [0] * (first + bs - end)
        return sample(self.states(rid, tokens, end), rows)


@dataclass
class Result:
    state_checks: int = 0
    failures: int = 0
    preemptions: int = 0
    restores: int = 0
    saves: int = 0
    hit_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    disk_hit_tokens: int = 0
    errors: list[str] = field(default_factory=list)


def run_workload(seed: int, layout: str, mutant: str | None = None, integrity: bool = True,
                 caching: bool = True, replay_decode: bool = True, disk: bool = False) -> Result:
    rng = random.Random(seed * 1000 + {"in-page": 0, "per-block": 1, "runs": 2}[layout])
    bs = 4
    G = 1 + seed % 3
    k = 2 if layout == "runs" else 1  # pages per state
    num_pages = rng.randint(28, 44) + (k - 1) * 4 * G
    max_num_seqs = rng.randint(3, 5)
    budget = bs * rng.randint(1, 5) + rng.randint(0, bs - 1)
    eviction = ValueEviction() if seed % 3 == 1 else None  # eviction by value on a third of the seeds
    mem = MemoryManager(num_pages, max_num_seqs, bs, G, caching=caching, layout=layout, pages_per_state=k,
                        eviction=eviction)
    # a checkpoint grid on two seeds of three: saves inside chunks, from free pages only
    sch = Scheduler(mem, max_num_seqs, budget, replay_decode=replay_decode, checkpoint_grid=bs * (seed % 3),
                    reprefill_outputs=seed % 2 == 0, job_tokens=bs)  # background jobs on half the seeds
    ex = ToyExecutor(mem, mutant)
    toy_disk = None
    if disk:  # room for about 40 records: the disk evicts too
        from deltaserve.memory.disk_tier import HEADER_BYTES, DiskTier

        tier = DiskTier(40 * (HEADER_BYTES + 1), 1, 1, ValueEviction() if seed % 3 == 1 else None)  # as the pool
        mem.attach_disk(tier)
        toy_disk = ToyDisk(ex, tier, random.Random(seed), mutant)
    ref = Reference(G, bs)
    res = Result()
    cap = sch.max_request_tokens()
    if mutant == "no_slot_handback":  # preemption frees pages but never gives the slot back
        real_preempt = sch.preempt

        def leaky_preempt(victim):
            slot = mem.slot_of(victim.request_id)
            real_preempt(victim)
            mem._free_slots.remove(slot)
            mem._slot_owner[slot] = f"leaked-{victim.request_id}"
        sch.preempt = leaky_preempt

    systems = [[rng.randint(1, VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    # a session: (salt, turns left, the conversation so far)
    pending_sessions = []
    for i in range(18):
        salt = rng.choice([None, None, None, "tenant-a", "tenant-b"])
        pending_sessions.append({"salt": salt, "turns": rng.randint(2, 5), "conv": list(rng.choice(systems)),
                                 "name": f"s{i}"})
    active: dict[str, tuple[dict, Request]] = {}  # request id -> (session, request)
    n_req = 0

    def start_turn(sess) -> None:
        nonlocal n_req
        sess["conv"] = sess["conv"] + [rng.randint(1, VOCAB) for _ in range(rng.randint(1, 24))]
        max_tokens = rng.randint(1, 20)
        if len(sess["conv"]) + max_tokens > cap:
            return
        n_req += 1
        req = Request(f"{sess['name']}-r{n_req}", list(sess["conv"]), max_tokens, cache_salt=sess["salt"])
        sch.add(req)
        active[req.request_id] = (sess, req)

    def done(rid: str) -> None:
        sess, req = active.pop(rid)
        if req.finish_reason == "abort":
            res.aborted += 1
        else:
            res.finished += 1
        sess["conv"] = list(req.prompt_token_ids) + list(req.output_token_ids)
        sess["turns"] -= 1
        if sess["turns"] > 0 and req.finish_reason != "abort":
            start_turn(sess)
        elif sess["turns"] > 0:
            pending_sessions.append(sess)

    def one_shot() -> None:  # a diverging prefix of a system prompt
        nonlocal n_req
        n_req += 1
        base = rng.choice(systems)
        toks = base[:rng.randint(1, len(base))] + [rng.randint(1, VOCAB) for _ in range(rng.randint(1, 40))]
        req = Request(f"o-r{n_req}", toks, rng.randint(1, 12), cache_salt=rng.choice([None, "tenant-a"]))
        sch.add(req)
        active[req.request_id] = ({"conv": [], "turns": 0}, req)

    empty_steps = 0
    try:
        while pending_sessions or active or sch.jobs.has_work():
            if pending_sessions and (len(active) < 6 or rng.random() < 0.1):
                start_turn(pending_sessions.pop(0))
            if rng.random() < 0.08:
                one_shot()
            if active and rng.random() < 0.01:  # abort between steps
                rid = rng.choice(sorted(active))
                sch.abort(rid)
                done(rid)
            ex.plant(mem.free_page_ids(), mem.free_slot_ids())
            plan = sch.schedule()
            res.steps += 1
            if integrity:  # before the disk's copies: queued loads are part of what it checks
                mem.check_integrity()
            if toy_disk is not None:
                toy_disk.sync()
            if plan.is_empty():
                empty_steps += 1
                if sch.has_unfinished() and empty_steps > 3:
                    raise Stall(f"no progress with {sch.num_waiting} waiting, {sch.num_running} running")
                continue
            empty_steps = 0
            assert plan.num_tokens <= budget and len(plan.work) <= max_num_seqs
            ex.pre(plan)
            for w in plan.work:  # the state checks (background jobs' too)
                req = active[w.request_id][1] if w.request_id in active else sch.requests[w.request_id]
                toks = req.all_token_ids
                res.state_checks += 1
                ok = list(w.token_ids) == toks[w.start_pos:w.start_pos + len(w.token_ids)]
                # the path: the prompt through prefill, every generated token through decode, one a step
                if w.is_decode:
                    ok &= w.start_pos >= req.num_prompt_tokens and len(w.token_ids) == 1
                else:  # a prefill chunk ends on a block boundary or at the end of what prefill computes
                    end, target = w.start_pos + len(w.token_ids), (req.num_prompt_tokens if replay_decode
                                                                    else req.num_tokens)
                    ok &= end <= target and (end % bs == 0 or (end == target and caching)
                                             or not caching)
                ok &= ex.slots[w.slot] == list(ref.states(w.request_id, toks, w.start_pos))
                for j in range(-(-w.start_pos // bs)):
                    lo, hi = j * bs, min((j + 1) * bs, w.start_pos)
                    ok &= ex.kv[w.page_ids[j]][:hi - lo] == toks[lo:hi]
                if not ok:
                    res.failures += 1
                    raise Mismatch(f"state check failed for {w.request_id} at {w.start_pos} (step {res.steps})")
            sampled = ex.forward(plan)
            if toy_disk is not None:
                toy_disk.after_step()
            for w in plan.work:
                if w.sample:
                    req = active[w.request_id][1]
                    end = w.start_pos + len(w.token_ids)
                    if sampled[w.request_id] != ref.next_token(w.request_id, req.all_token_ids, end):
                        res.failures += 1
                        raise Mismatch(f"wrong token sampled for {w.request_id} at {end} (step {res.steps})")
            ours = [w.request_id for w in plan.work if w.request_id in active]
            if ours and rng.random() < 0.01:  # abort between schedule() and update()
                rid = rng.choice(ours)
                sch.abort(rid)
                done(rid)
            advanced = sch.update(plan, sampled)
            for req in advanced:
                if not req.is_finished and req.output_token_ids[-1] == STOP_TOKEN:
                    sch.finish(req.request_id, "stop")
            for rid in [r for r, (_, q) in active.items() if q.is_finished]:
                done(rid)
            if integrity:
                mem.check_integrity()
            if res.steps > 20000:
                raise Stall("too many steps")
        u = mem.usage()
        assert u.pages_used == 0 and u.slots_used == 0, f"left allocated: {u}"
        assert not sch.has_unfinished()
    except (AssertionError, CheckpointError, Stall, KeyError, RuntimeError) as e:
        if not isinstance(e, Mismatch):
            res.failures += 1
        res.errors.append(f"{type(e).__name__}: {e}")
    st = sch.memory.stats
    res.preemptions, res.restores, res.saves, res.hit_tokens = (sch.stats.preemptions, st.checkpoints_restored,
                                                                 st.checkpoints_saved, sch.stats.prefix_cache_hits)
    res.disk_hit_tokens = mem.disk_stats().disk_hit_tokens
    return res


SEEDS = range(12)
LAYOUTS = ("in-page", "runs", "per-block")


# six seeds by default, all twelve under the slow mark; the floors below are per seed (set for twelve seeds: 10,000
# state checks, 400 preemptions)
@pytest.mark.parametrize("seeds", [range(6), pytest.param(SEEDS, marks=pytest.mark.slow)], ids=["6", "12"])
def test_state_machine_all_seeds_all_layouts(seeds):
    totals = Result()
    per_layout = {}
    for layout in LAYOUTS:
        restores = 0
        for seed in seeds:
            r = run_workload(seed, layout)
            assert r.failures == 0, (seed, layout, r.errors)
            totals.state_checks += r.state_checks
            totals.preemptions += r.preemptions
            totals.finished += r.finished
            totals.aborted += r.aborted
            restores += r.restores
            assert r.saves > 0 and r.restores > 0, (seed, layout, r)
        per_layout[layout] = restores
    print(f"state machine: {len(seeds)} seeds x {len(LAYOUTS)} layouts, {totals.state_checks} state checks, "
          f"{totals.preemptions} preemptions, {totals.finished} finished, {totals.aborted} aborted, "
          f"restores {per_layout}, 0 failures")
    assert totals.state_checks >= 10_000 * len(seeds) // 12
    assert totals.preemptions >= 400 * len(seeds) // 12
    assert totals.aborted > 0


def test_state_machine_caching_off():
    """No cache: no saves, restores or hits; preempted requests recompute from a zeroed slot."""
    checks = preemptions = 0
    for seed in range(4):
        r = run_workload(seed, "in-page", caching=False)
        assert r.failures == 0, (seed, r.errors)
        assert r.saves == r.restores == r.hit_tokens == 0
        checks += r.state_checks
        preemptions += r.preemptions
    assert checks > 1000 and preemptions > 10


@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_machine_recompute_through_prefill(layout):
    """replay_decode=False: preempted requests recompute generated tokens by prefill (vLLM's way)."""
    checks = preemptions = 0
    for seed in range(4):
        r = run_workload(seed, layout, replay_decode=False)
        assert r.failures == 0, (seed, r.errors)
        checks += r.state_checks
        preemptions += r.preemptions
    assert checks > 1000 and preemptions > 20


MUTANTS = ["no_save", "no_restore", "no_slot_handback", "no_zero_pages", "no_zero_slots", "save_a_block_late"]


@pytest.mark.parametrize("mutant", MUTANTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mutant_is_caught(mutant, layout):
    # the slot mutant is caught without check_integrity(): slots run dry and the engine stalls
    integrity = mutant != "no_slot_handback"
    caught = [run_workload(seed, layout, mutant, integrity) for seed in (3, 5, 7)]
    assert all(r.failures > 0 for r in caught), [(r.failures, r.errors) for r in caught]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_machine_with_a_disk_tier(layout):
    """Evicted blocks and checkpoints go to a toy disk and come back on hits; every state check still holds."""
    checks = disk_hits = 0
    for seed in range(6):
        r = run_workload(seed, layout, disk=True)
        assert r.failures == 0, (seed, r.errors)
        checks += r.state_checks
        disk_hits += r.disk_hit_tokens
    assert checks > 1000 and disk_hits > 100


@pytest.mark.parametrize("mutant", ["disk_load_garbage", "disk_spill_late"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_disk_mutant_is_caught(mutant, layout):
    caught = [run_workload(seed, layout, mutant, disk=True) for seed in (0, 1, 2, 3)]
    assert any(r.failures > 0 for r in caught), [(r.failures, r.errors) for r in caught]
