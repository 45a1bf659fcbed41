"""The prefix cache's disk tier (--cache-disk) on the tiny model: restart, pressure and fault gates.

Every turn served through the disk is compared with its cold twin (the same prompt computed from scratch):
tokens identical and logprobs bit-identical. A fault (a flipped byte, a truncated record, another fingerprint, a
full disk, a write killed midway) must give a miss and a log line, never a wrong answer or a crash.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import stat
import time

import pytest
from util import make_llm, random_tokens, run, signature

LAYOUTS = ["in-page", "runs", "per-block"]


def _session(seed: int, n: int = 700):
    rng = random.Random(seed)
    return rng, random_tokens(rng, n)


def _cold(layout: str, prompts, **kw):
    cold = make_llm(cache_layout=layout, **kw)
    return [signature(o) for o in run(cold, prompts)]


def _turns(layout: str, directory: str, seed: int = 0, **kw):
    """Turn 1 on an engine over `directory`, closed; the turn-2 prompt (turn 1 + its outputs + new tokens)."""
    rng, p1 = _session(seed)
    llm = make_llm(cache_layout=layout, cache_disk=directory, **kw)
    out = run(llm, [p1])[0]
    llm.close()
    return p1 + out.outputs[0].token_ids + random_tokens(rng, 150)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_restart_hits_from_disk_and_equals_cold(layout, tmp_path):
    d = str(tmp_path / "tier")
    turn2 = _turns(layout, d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    recs = [n for n in os.listdir(d) if n.endswith(".rec")]
    assert recs and all(stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode) == 0o600 for n in recs)
    llm = make_llm(cache_layout=layout, cache_disk=d)
    out = run(llm, [turn2])[0]
    s = llm.engine.stats()
    llm.engine.memory.check_integrity()
    assert out.num_cached_tokens >= 640 and s.disk_hit_tokens >= 640 and s.disk_reads > 0 and not s.disk_read_errors
    assert signature(out) == _cold(layout, [turn2])[0]
    llm.close()
    from deltaserve.server.metrics import ServerMetrics

    text = ServerMetrics(llm.engine.stats, "m").render().decode()
    assert f'deltaserve_disk_hit_tokens_total{{model_name="m"}} {float(s.disk_hit_tokens)}' in text
    assert "deltaserve_disk_bytes" in text and "deltaserve_disk_read_seconds_total" in text


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pressure_blocks_evicted_to_disk_come_back_bit_exact(layout, tmp_path):
    """A pool that holds about one session: the others' blocks go to disk and come back for their next turn."""
    from test_engine import _budget_for_pages

    rng = random.Random(5)
    firsts = [random_tokens(rng, 450) for _ in range(4)]
    pages = {"in-page": 12, "per-block": 10, "runs": 30}[layout]
    kw = {"kv_cache_memory": _budget_for_pages(pages, layout), "max_num_seqs": 6, "checkpoint_grid": 0}
    llm = make_llm(cache_layout=layout, cache_disk=str(tmp_path / "tier"), **kw)
    # one session at a time: each evicts the ones before, whose next turns then need the disk
    seconds = [p + run(llm, [p])[0].outputs[0].token_ids + random_tokens(rng, 100) for p in firsts]
    outs = [run(llm, [p])[0] for p in seconds]
    s = llm.engine.stats()
    llm.engine.memory.check_integrity()
    assert s.evictions > 0 and s.disk_writes > 0 and s.disk_hit_tokens > 0 and not s.disk_read_errors
    assert all(o.num_cached_tokens >= 384 for o in outs) and s.disk_hit_tokens >= 4 * 384
    assert [signature(o) for o in outs] == _cold(layout, seconds)
    llm.close()


# ---------------------------------------------------------------- faults


@pytest.fixture(scope="module", params=LAYOUTS)
def filled(request, tmp_path_factory):
    """Per layout: a tier directory after one turn, the next turn's prompt and that turn's cold signature."""
    layout = request.param
    d = str(tmp_path_factory.mktemp("filled") / "tier")
    turn2 = _turns(layout, d, seed=1)
    return layout, d, turn2, _cold(layout, [turn2])[0]


def _second_turn(filled, tmp_path, tamper=None, **kw):
    layout, src, turn2, cold = filled
    d = str(tmp_path / "tier")
    shutil.copytree(src, d)
    os.remove(os.path.join(d, "LOCK"))
    if tamper is not None:
        tamper(d)
    llm = make_llm(cache_layout=layout, cache_disk=d, **kw)
    out = run(llm, [turn2])[0]
    s = llm.engine.stats()
    llm.engine.memory.check_integrity()
    llm.close()
    assert signature(out) == cold, "a fault must never change the answer"
    return out, s, d


def _records(d: str, kind: str = "") -> list[str]:
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".rec") and n.startswith(kind))


def test_a_flipped_byte_is_a_miss(filled, tmp_path, caplog):
    def flip(d):
        for path in _records(d, "ckpt"):
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) - 100)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x10]))

    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        out, s, _ = _second_turn(filled, tmp_path, flip)
    assert s.disk_read_errors >= 1 and out.num_cached_tokens == 0
    assert "checksum mismatch (corrupt)" in caplog.text and "a miss" in caplog.text


def test_a_truncated_record_is_a_miss(filled, tmp_path, caplog):
    def truncate(d):
        for path in _records(d, "ckpt"):
            os.truncate(path, os.path.getsize(path) // 2)

    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        out, s, _ = _second_turn(filled, tmp_path, truncate)
    assert out.num_cached_tokens == 0 and s.disk_reads == 0
    assert "truncated" in caplog.text


@pytest.mark.parametrize("filled", ["runs"], indirect=True)
def test_a_tampered_fingerprint_file_is_rebuilt_and_the_records_still_hit(filled, tmp_path, caplog):
    """FINGERPRINT only describes the directory: the records' headers say whose they are."""
    def other_model(d):
        path = os.path.join(d, "FINGERPRINT")
        with open(path) as f:
            fp = json.load(f)
        for fields in (fp.values() if "format" not in fp else [fp]):
            fields["model"] = "another model's digest"
        with open(path, "w") as f:
            json.dump(fp, f)

    out, s, d = _second_turn(filled, tmp_path, other_model)
    assert out.num_cached_tokens >= 640 and s.disk_reads > 0 and not s.disk_read_errors
    with open(os.path.join(d, "FINGERPRINT")) as f:
        assert all(fields["model"] != "another model's digest" for fields in json.load(f).values())


@pytest.mark.parametrize("filled", ["runs"], indirect=True)
def test_a_record_of_another_fingerprint_is_a_miss_and_kept(filled, tmp_path, caplog):
    """A record whose header carries another fingerprint (copied from elsewhere): no hit, not deleted."""
    def foreign(d):
        from deltaserve.runner import disk_store

        for path in _records(d, "kv"):
            with open(path, "rb") as f:
                data = f.read()
            hlen, _ = disk_store._HEAD.unpack(data[8:disk_store._PREFIX])
            header = data[disk_store._PREFIX:disk_store._PREFIX + hlen]
            d0 = json.loads(header)["fingerprint"]
            with open(path, "wb") as f:
                f.write(data.replace(d0.encode(), b"0" * len(d0), 1))

    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        out, _, d = _second_turn(filled, tmp_path, foreign)
    assert out.num_cached_tokens == 0 and "fingerprint mismatch" in caplog.text and "kept" in caplog.text
    theirs = [p for p in _records(d, "kv") if os.path.basename(p) in os.listdir(os.path.join(filled[1]))]
    assert len(theirs) == len(_records(filled[1], "kv")) > 0  # each stays beside the new turn's own


def test_a_write_killed_midway_leaves_no_record_that_can_hit(filled, tmp_path, caplog):
    """kill -9 during a write leaves its temp file (never a record under the final name): removed at start-up; the
    records that were whole still hit."""
    def killed(d):
        victim = _records(d, "ckpt")[-1]
        with open(victim, "rb") as f:
            data = f.read()
        name = os.path.basename(victim)
        with open(os.path.join(d, f".tmp-{name}-4242-1"), "wb") as f:
            f.write(data[: len(data) // 3])

    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        out, s, d = _second_turn(filled, tmp_path, killed)
    assert out.num_cached_tokens > 0 and not s.disk_read_errors
    assert "did not finish (a crash)" in caplog.text
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]


def test_a_full_disk_drops_the_records(filled, tmp_path, caplog, monkeypatch):
    from deltaserve.runner import disk_store

    real = disk_store._write_all

    def full(fd, data):
        if len(data) > 10_000:  # the header goes in, the payload does not
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(disk_store, "_write_all", full)
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        _, _, d = _second_turn(filled, tmp_path)  # the close writes the new turn's blocks: each fails
    assert "the disk is full" in caplog.text
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]
    monkeypatch.setattr(disk_store, "_write_all", real)


def test_a_budget_too_small_for_any_record_writes_nothing(tmp_path):
    d = str(tmp_path / "tier")
    _, p1 = _session(2, 300)
    llm = make_llm(cache_disk=d, cache_disk_bytes=10_000)
    run(llm, [p1])
    llm.close()
    s = llm.engine.stats()
    assert s.disk_write_errors > 0 and s.disk_records == 0 and not _records(d)


def test_a_directory_in_use_is_refused(tmp_path):
    from deltaserve.config import ConfigError

    d = str(tmp_path / "tier")
    llm = make_llm(cache_disk=d)
    with pytest.raises(ConfigError, match="in use"):
        make_llm(cache_disk=d)
    llm.close()
    make_llm(cache_disk=d).close()


def test_config_refuses_a_disk_tier_without_caching():
    from deltaserve.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="--cache-disk"):
        EngineConfig(cache_disk="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="--cache-disk-bytes"):
        EngineConfig(cache_disk_bytes=0)


# ---------------------------------------------------------------- the manager's decisions, torch-free


def test_manager_spills_what_it_evicts_and_reads_it_back():
    from deltaserve.memory import MemoryManager, block_hash, root_hash
    from deltaserve.memory.manager import DISK_GO, DISK_READING
    from deltaserve.memory.disk_tier import CKPT, HEADER_BYTES, KV, DiskTier
    from deltaserve.memory.events import DISK, POOL, RouterView, Stored

    bs = 4
    mem = MemoryManager(num_pages=8, num_slots=2, block_size=bs, num_gdn_groups=1, layout="in-page")
    tier = DiskTier(20 * (HEADER_BYTES + 8), 8, 8)
    mem.attach_disk(tier)
    records = mem.enable_events()
    pool_view, disk_view = RouterView(bs, 3 * bs), RouterView(bs, 3 * bs, medium=DISK)

    def keys(tokens):
        out, parent = [], root_hash(None)
        for j in range(len(tokens) // bs):
            h = block_hash(parent, tokens[j * bs:(j + 1) * bs])
            out.append((h, parent, tokens[j * bs:(j + 1) * bs]))
            parent = h
        return out

    def compute(sid, tokens):
        mem.admit(sid)
        mem.append_pages(sid, len(tokens))
        mem.reserve_checkpoint(sid, len(tokens), "prompt")
        mem.publish(sid, keys(tokens))
        mem.commit_checkpoints(sid)
        mem.free(sid)
        mem.check_integrity()

    def worker():  # what runner/disk_store.py does: every write and read succeeds
        ops, loads = tier.take()
        for op, arg in ops:
            if op in ("write", "read"):
                rec = arg.record if op == "write" else arg
                tier.done.append((op, rec.key, True, 0.001, rec.nbytes))
        return ops, loads

    a = list(range(1, 13))
    compute("a", a)
    assert not tier.take()[0]  # nothing evicted: nothing written
    compute("b", list(range(100, 128)))  # seven pages and a checkpoint: a's blocks and checkpoint leave the pool
    ops, _ = worker()
    written = {arg.record.key for op, arg in ops if op == "write"}
    ha = [k[0] for k in keys(a)]
    assert {(KV, h) for h in ha} | {(CKPT, ha[-1])} <= written and mem.stats.evictions > 0
    assert [e for e in pool_view.feed(list(records)) if isinstance(e, Stored)]
    stored = [e for e in disk_view.feed(list(records)) if isinstance(e, Stored)]
    assert [e.token_ids for e in stored] == [tuple(a)]  # the disk announces a's prefix under the DISK medium
    assert all(r.medium in (POOL, DISK) for r in records)

    def tokens_of(j):
        return a[j * bs:(j + 1) * bs]

    assert mem.find_prefix(root_hash(None), ha, tokens_of, 3).num_blocks == 0
    assert mem.prepare_from_disk(root_hash(None), ha, tokens_of, 3) == DISK_READING  # reads asked for: wait
    ops, _ = worker()
    assert sorted(arg.key for op, arg in ops if op == "read") == sorted({(KV, h) for h in ha} | {(CKPT, ha[-1])})
    mem.check_integrity()
    assert mem.prepare_from_disk(root_hash(None), ha, tokens_of, 3) == DISK_GO  # staged: installed in the pool
    hit = mem.find_prefix(root_hash(None), ha, tokens_of, 3)
    assert hit.num_blocks == 3 and tier.stats.disk_hit_tokens == 3 * bs and tier.stats.disk_reads == 4
    _, loads = worker()
    assert sorted(ld.record.key for ld in loads) == sorted({(KV, h) for h in ha} | {(CKPT, ha[-1])})
    assert {ld.location for ld in loads if ld.record.kind == KV} == {(p,) for p in hit.page_ids}
    mem.check_integrity()
    mem.admit("c", hit)
    mem.free("c")
    mem.check_integrity()


def test_a_failed_read_is_a_miss_and_the_next_lookup_asks_for_what_is_left():
    from deltaserve.memory.disk_tier import HEADER_BYTES, KV, DiskRecord, DiskTier

    tier = DiskTier(2 * (HEADER_BYTES + 8), 8, 8)
    r1, r2, r3 = (DiskRecord(KV, bytes([i]) * 32, b"p" * 32, (i,), 8) for i in range(3))
    tier.adopt([r1, r2])
    tier.read(r1)
    tier.done.append(("read", r1.key, False, 0.0, 0))
    tier.poll()
    assert tier.get(KV, r1.hash) is None and tier.stats.disk_read_errors == 1
    assert tier.add(r3) and tier.add(DiskRecord(KV, b"x" * 32, b"p" * 32, (9,), 8))  # r2 evicted (LRU)
    assert tier.get(KV, r2.hash) is None and tier.stats.disk_evictions == 1
    ops, _ = tier.take()
    assert [op for op, _ in ops] == ["read", "delete", "delete"]
    tier.check_integrity()
    assert not tier.add(DiskRecord(KV, b"y" * 32, b"p" * 32, (9,), 3 * HEADER_BYTES))  # bigger than the budget


def test_fleet_bench_runs_a_disk_arm(tmp_path, capsys):
    from deltaserve.bench import main

    rc = main(["fleet", "--preset", "tiny", "--sessions", "3", "--turns", "2", "--shared-tokens", "300",
               "--new-tokens", "20,40", "--output-tokens", "4", "--kv-cache-memory", "12M", "--arms", "runs",
               "--cache-disk", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| runs |" in text and "| runs+disk |" in text and "| disk arm | hit tokens from disk |" in text


class Driver:
    """Steps a scheduler over a memory manager with a disk tier as the engine does, the I/O worker stood in for:
    every write lands at once, a read lands at once unless deliver=False (its key is noted in `landed` either
    way); each sampled request gets token 5."""

    def __init__(self, s, mem, tier):
        self.s, self.mem, self.tier, self.landed = s, mem, tier, []

    def step(self, deliver: bool = True):
        plan = self.s.schedule()
        self.mem.check_integrity()
        ops, _ = self.tier.take()
        for op, arg in ops:
            if op == "write":
                self.tier.done.append(("write", arg.record.key, True, 0.0, arg.record.nbytes))
            elif op == "read":
                self.landed.append(arg.key)
                if deliver:
                    self.tier.done.append(("read", arg.key, True, 0.001, arg.nbytes))
        self.s.update(plan, {w.request_id: 5 for w in plan.work if w.sample})
        self.tier.poll()  # as the engine's next sync does: the gauges follow the writes
        return plan

    def finish(self, rid, steps: int = 200):
        for _ in range(steps):
            if rid not in self.s.requests:
                return
            self.step()
        raise AssertionError(f"{rid} did not finish")


def test_a_request_waiting_for_the_disk_lets_the_others_run():
    """Its reads in flight, the request waits in the queue; the one behind it is admitted and runs; once the reads
    land, the first is admitted with the hit the disk gave."""
    from deltaserve.memory import MemoryManager
    from deltaserve.memory.disk_tier import HEADER_BYTES, DiskTier
    from deltaserve.scheduler import Request, Scheduler

    bs = 4
    mem = MemoryManager(num_pages=10, num_slots=3, block_size=bs, num_gdn_groups=1, layout="in-page")
    tier = DiskTier(50 * (HEADER_BYTES + 8), 8, 8)
    mem.attach_disk(tier)
    s = Scheduler(mem, 3, 16)
    d = Driver(s, mem, tier)
    step, finish, landed = d.step, d.finish, d.landed

    a = list(range(1, 14))  # 13 tokens: three full blocks, their checkpoint at 12
    s.add(Request("a", a, max_tokens=1))
    finish("a")
    s.add(Request("b", list(range(100, 129)), max_tokens=1))  # fills the pool: a's blocks go to disk
    finish("b")
    assert tier.stats.disk_records >= 4  # a's three blocks and its checkpoint
    s.add(Request("a2", a + [50, 51], max_tokens=1))
    s.add(Request("c", list(range(200, 206)), max_tokens=1))
    plan = step(deliver=False)
    assert [w.request_id for w in plan.work] == ["c"] and s.requests["a2"].disk_wait and landed
    for key in landed:
        tier.done.append(("read", key, True, 0.001, 8))
    plan = step()
    work = {w.request_id: w for w in plan.work}
    assert "a2" in work and work["a2"].start_pos == 12 and s.get("a2").num_cached_tokens == 12
    assert tier.stats.disk_hit_tokens == 12


def test_disk_eviction_follows_the_pools_policy():
    """lru drops the oldest record; value the one that spares the least (a checkpoint worth many tokens stays)."""
    from deltaserve.memory.disk_tier import CKPT, HEADER_BYTES, KV, DiskRecord, DiskTier
    from deltaserve.memory.eviction import LRUEviction, ValueEviction

    ck = DiskRecord(CKPT, b"c" * 32, b"p" * 32, (1,), 8, "prompt")
    kv1, kv2 = (DiskRecord(KV, bytes([i]) * 32, b"p" * 32, (i,), 8) for i in (1, 2))
    for policy, gone in ((LRUEviction(), ck), (ValueEviction(), kv1)):
        tier = DiskTier(2 * (HEADER_BYTES + 8), 8, 8, policy)
        tier.spill(ck, (0,), 1000.0)
        tier.spill(kv1, (1,), 64.0)
        tier.spill(kv2, (2,), 64.0)
        assert tier.get(gone.kind, gone.hash) is None and len(tier) == 2 and tier.stats.disk_evictions == 1
        tier.check_integrity()


def test_a_disk_hit_without_room_waits_for_it_instead_of_recomputing():
    """The staged records need more pages than are allocatable while another request runs, though the first
    chunk of a recomputation would fit: the request waits (FCFS: the one behind it too) until the running one
    releases its pages, then takes the whole hit from disk. With nothing running to make room, it goes on with
    the pool's hit."""
    from deltaserve.memory import MemoryManager
    from deltaserve.memory.disk_tier import HEADER_BYTES, DiskTier
    from deltaserve.scheduler import Request, Scheduler

    bs = 4
    mem = MemoryManager(num_pages=16, num_slots=3, block_size=bs, num_gdn_groups=1, layout="runs",
                        pages_per_state=2)
    tier = DiskTier(80 * (HEADER_BYTES + 16), 16, 32)
    mem.attach_disk(tier)
    s = Scheduler(mem, 3, 5)  # a decode and a page of prefill per step
    d = Driver(s, mem, tier)
    step, finish = d.step, d.finish

    a = list(range(1, 18))  # 17 tokens: four full blocks, the prompt's checkpoint at 16
    s.add(Request("a", a, max_tokens=1))
    finish("a")
    s.add(Request("b", list(range(100, 137)), max_tokens=1))  # fills the pool: a's blocks go to disk
    finish("b")
    assert tier.stats.disk_records >= 5
    s.add(Request("d", list(range(300, 341)), max_tokens=6))  # runs on, holding most of the pool
    while s.get("d").num_computed_tokens < 41:
        step()
    free_now = mem.num_allocatable()
    s.add(Request("a2", a + [50, 51], max_tokens=1))
    step()
    assert s.requests["a2"].disk_wait  # its reads are in flight
    s.add(Request("c", [200, 201], max_tokens=1))
    plan = step()
    assert 1 <= free_now < 4 + mem.checkpoint_pages  # a chunk fits; a's four blocks and checkpoint do not
    assert {w.request_id for w in plan.work} == {"d"} and not s.requests["a2"].disk_wait
    assert s.get("a2").num_computed_tokens == 0 and s.get("c").num_computed_tokens == 0
    while "d" in s.requests:
        plan = step()
        assert "c" not in {w.request_id for w in plan.work}  # first come, first served
    hit = next(w for w in step().work if w.request_id == "a2")
    assert hit.start_pos == 16 and s.get("a2").num_cached_tokens == 16 and tier.stats.disk_hit_tokens == 16
    finish("a2")
    finish("c")
    mem.check_integrity()


@pytest.mark.parametrize("with_disk", [False, True])
def test_with_a_disk_tier_a_request_waits_for_room_for_its_prompt_checkpoint(with_disk):
    """Its prompt fits the pool beside a running request, its prompt checkpoint does not. Without a disk tier it runs
    at once without that checkpoint (optional, taken where it fits); with one it waits for the running request's
    pages, and its next turn could then resume from disk at the prompt's end."""
    from deltaserve.memory import MemoryManager
    from deltaserve.memory.disk_tier import HEADER_BYTES, DiskTier
    from deltaserve.scheduler import Request, Scheduler

    bs = 4
    mem = MemoryManager(num_pages=16, num_slots=3, block_size=bs, num_gdn_groups=1, layout="runs",
                        pages_per_state=2)
    tier = DiskTier(80 * (HEADER_BYTES + 16), 16, 32)
    if with_disk:
        mem.attach_disk(tier)
    s = Scheduler(mem, 3, 16)
    step = Driver(s, mem, tier).step

    s.add(Request("d", list(range(300, 333)), max_tokens=6))  # 33 tokens: nine pages, and decodes on
    while s.get("d").num_computed_tokens < 33:
        step()
    room = mem.num_allocatable()
    s.add(Request("e", list(range(1, 14)), max_tokens=1))  # 13 tokens: four pages, its prompt checkpoint at 12
    assert 4 <= room < 4 + mem.checkpoint_pages
    saved = mem.stats.checkpoints_saved_by_kind["prompt"]
    ran_beside_d = False
    while "e" in s.requests:
        ran_beside_d |= "e" in {w.request_id for w in step().work} and "d" in s.requests
    assert ran_beside_d != with_disk
    assert (mem.stats.checkpoints_saved_by_kind["prompt"] > saved) == with_disk


# ---------------------------------------------------------------- faults of the file system, store level (no model)


class _Pool:
    """CacheStore's record API over a dict (location -> bytes): DiskStore without a model."""

    def __init__(self, kv: int = 64, ckpt: int = 96):
        self.sizes, self.data = {"kv": kv, "ckpt": ckpt}, {}

    def record_bytes(self, kind):
        return self.sizes[kind]

    def read_record(self, kind, location):
        return self.data[location]

    def write_record(self, kind, location, data):
        self.data[location] = bytes(data)


class _Memory:
    def attach_disk(self, tier):
        self.disk = tier


def _store(d, capacity=1 << 20, model="a", eviction=None):
    from deltaserve.runner.disk_store import DiskStore

    pool = _Pool()
    return DiskStore(str(d), capacity, _Memory(), pool, {"format": 1, "model": model}, eviction), pool


def _rec(i: int):
    import hashlib

    from deltaserve.memory.disk_tier import KV, DiskRecord

    return DiskRecord(KV, hashlib.sha256(bytes([i])).digest(), b"p" * 32, (i,), 64)


def _settle(st):
    """What the engine's steps do: hand the decisions to the worker, wait for it, take what it finished."""
    for _ in range(3):
        st.sync()
        st.drain()
    st.tier.poll()


def _spill(st, pool, i: int, value: float = 0.0):
    pool.data[(i,)] = bytes([i]) * 64
    st.tier.spill(_rec(i), (i,), value)
    _settle(st)


def _read_back(st, i: int) -> bool:
    rec = _rec(i)
    if st.tier.get(rec.kind, rec.hash) is None:
        return False
    st.tier.read(rec)
    _settle(st)
    return rec.key in st.tier.staged


def _kept(d) -> set[int]:
    """Which of _rec(0..255) have a record file in d (any fingerprint)."""
    names = [n for n in os.listdir(d) if n.endswith(".rec")]
    return {i for i in range(256) if any(n.startswith(f"kv-{_rec(i).hash.hex()}") for n in names)}


def _age(d, order):
    """Written in this order, seconds apart (a file system's clock may give records written together one mtime)."""
    names = [n for n in os.listdir(d) if n.endswith(".rec")]
    now = time.time_ns()
    for k, i in enumerate(order):
        for n in names:
            if n.startswith(f"kv-{_rec(i).hash.hex()}"):
                t = now - (100 - 10 * k) * 10**9
                os.utime(os.path.join(d, n), ns=(t, t))


ONE = 64 + 4096  # a _rec's charge against the budget (memory/disk_tier.py HEADER_BYTES)


def test_read_back_recency_survives_a_restart(tmp_path):
    """lru: a record read back before the restart outlives those written after it, once the budget needs room."""
    d = tmp_path / "tier"
    st, pool = _store(d)
    for i in range(4):
        _spill(st, pool, i)
    _age(d, range(4))
    assert _read_back(st, 0)
    st.close()
    st, _ = _store(d, capacity=3 * ONE)  # a smaller budget: the least recently used record goes at start-up
    _settle(st)
    assert _kept(d) == {0, 2, 3} and len(st.tier) == 3
    assert _read_back(st, 0)
    st.close()


def test_the_value_policy_keeps_its_values_over_a_restart(tmp_path):
    from deltaserve.memory.eviction import ValueEviction

    d = tmp_path / "tier"
    st, pool = _store(d, eviction=ValueEviction())
    for i, value in enumerate((50.0, 20.0, 1.0)):
        _spill(st, pool, i, value)
    _age(d, range(3))
    st.close()
    st, _ = _store(d, capacity=2 * ONE, eviction=ValueEviction())
    _settle(st)
    assert _kept(d) == {0, 1}  # the least valuable went, not the oldest
    assert st.tier.value_of(_rec(0).key) == 50.0
    st.close()


def _small_disk(monkeypatch, records: int):
    """A file system that holds `records` records: a write that would need more space fails with ENOSPC."""
    from deltaserve.runner import disk_store

    real = disk_store._write_all

    def write(fd, data):
        d = os.path.dirname(os.readlink(f"/proc/self/fd/{fd}"))
        if sum(n.endswith(".rec") for n in os.listdir(d)) >= records:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(disk_store, "_write_all", write)


def test_a_budget_larger_than_the_disk_evicts_and_retries(tmp_path, monkeypatch, caplog):
    """The disk holds three records, the budget a megabyte: each failed write evicts by policy and is tried once
    more, so the newest records are kept (never the first ones forever), the budget comes down to the disk's size,
    the warnings are rate-limited and the gauges count the files."""
    _small_disk(monkeypatch, 3)
    d = tmp_path / "tier"
    st, pool = _store(d)
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        for i in range(8):
            _spill(st, pool, i)
    assert _kept(d) == {5, 6, 7}  # lru: the oldest records made room
    s = st.tier.stats
    assert s.disk_records == 3 == len(_records(str(d))) and s.disk_bytes == 3 * ONE and s.disk_writes == 8
    assert st.tier.capacity < 4 * ONE and st.tier.writable
    assert caplog.text.count("writing kv-") == 1  # one line for the five failures (rate-limited)
    assert _read_back(st, 7) and not [n for n in os.listdir(d) if n.startswith(".tmp-")]
    st.tier.check_integrity()
    st.close()


def _one_record_then_failing_writes(tmp_path, monkeypatch, code: int, message: str):
    """A tier holding record 0, whose every later write fails with OSError(code, message)."""
    from deltaserve.runner import disk_store

    d = tmp_path / "tier"
    st, pool = _store(d)
    _spill(st, pool, 0)

    def fail(fd, data):
        raise OSError(code, message)

    monkeypatch.setattr(disk_store, "_write_all", fail)
    return d, st, pool


def test_a_disk_that_stays_full_stops_the_writing_and_the_gauges_count_the_files(tmp_path, monkeypatch, caplog):
    # another program's files fill the disk
    d, st, pool = _one_record_then_failing_writes(tmp_path, monkeypatch, errno.ENOSPC, "No space left on device")
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        for i in range(1, 6):
            pool.data[(i,)] = bytes([i]) * 64
            st.tier.spill(_rec(i), (i,))
            st.sync()  # a step, no lookup: the gauges must still follow the files
            st.drain()
            st.sync()
            st.drain()
            assert st.tier.stats.disk_records == len(_records(str(d))), i
    assert not st.tier.writable and caplog.text.count("stopped writing") == 1
    assert caplog.text.count("writing kv-") <= 2
    assert st.tier.stats.disk_bytes == ONE * len(_records(str(d)))
    st.tier.check_integrity()
    st.close()


def test_a_refused_write_turns_the_tier_read_only(tmp_path, monkeypatch, caplog):
    d, st, pool = _one_record_then_failing_writes(tmp_path, monkeypatch, errno.EROFS, "Read-only file system")
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        for i in range(1, 4):
            _spill(st, pool, i)
    assert not st.tier.writable and caplog.text.count("writing kv-") == 1 and _kept(d) == {0}
    assert _read_back(st, 0)
    st.close()


def test_a_missing_fingerprint_file_is_rebuilt_from_the_records(tmp_path, caplog):
    d = tmp_path / "tier"
    st, pool = _store(d)
    for i in range(3):
        _spill(st, pool, i)
    st.close()
    os.remove(d / "FINGERPRINT")
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        st, _ = _store(d)
    assert "FINGERPRINT missing: rebuilt from the headers of its 3 records" in caplog.text
    assert len(st.tier) == 3 and _kept(d) == {0, 1, 2} and _read_back(st, 1)
    with open(d / "FINGERPRINT") as f:
        assert st.fp_digest in json.load(f)
    st.close()


def test_records_of_two_models_share_the_directory_and_the_budget(tmp_path, caplog):
    """Model b starts on model a's directory: a's records stay (misses for b), b's records of the same blocks
    are written beside them, a's go only when the budget needs their room, and a reads its own back."""
    d = tmp_path / "tier"
    a, pool = _store(d, model="a")
    for i in range(3):
        _spill(a, pool, i)
    a.close()
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        b, pool = _store(d, capacity=5 * ONE, model="b")
    assert "fingerprint mismatch (model differ)" in caplog.text and "3 records of 1 other fingerprints kept" in caplog.text
    assert len(b.tier) == 0 and b.tier.foreign == 3 and b.tier.stats.disk_records == 3
    assert not _read_back(b, 0)  # a's record of block 0 is no hit for b
    for i in range(3):
        _spill(b, pool, i)  # room for two: a's oldest record goes for the third
    assert len(_records(str(d))) == 5 and b.tier.stats.disk_evictions == 1
    b.close()
    a, _ = _store(d, capacity=5 * ONE, model="a")
    assert len(a.tier) == 2 and a.tier.foreign == 3 and _read_back(a, 1) and _read_back(a, 2)
    a.close()


def test_the_directory_keeps_its_mode(tmp_path):
    d = tmp_path / "tier"
    d.mkdir(mode=0o750)
    os.chmod(d, 0o750)
    st, pool = _store(d)
    _spill(st, pool, 0)
    st.close()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o750


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only; skipped otherwise): (mount point, remount(options))."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mount -t tmpfs failed: {r.stderr.strip()}")

    def remount(opts: str):
        subprocess.run(["mount", "-o", f"remount,{opts}", str(mnt)], check=True)

    yield mnt, remount
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt):
    """Write until the file system is full."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_read_only_directory_is_served_read_only(small_tmpfs, caplog):
    mnt, remount = small_tmpfs
    d = mnt / "tier"
    st, pool = _store(d)
    for i in range(3):
        _spill(st, pool, i)
    st.close()
    remount("ro")
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        st, pool = _store(d)
    assert not st.writable and "cannot write (Read-only file system)" in caplog.text
    assert len(st.tier) == 3 and _read_back(st, 2)
    _spill(st, pool, 9)  # nothing written, no error
    assert _kept(d) == {0, 1, 2} and not st.tier.stats.disk_write_errors
    st.close()


def test_a_disk_full_at_start_up_serves_without_writing(small_tmpfs, caplog):
    mnt, _ = small_tmpfs
    _fill(mnt)
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        st, pool = _store(mnt / "tier")
    assert not st.writable and "cannot write (No space left on device)" in caplog.text
    assert [n for n in os.listdir(mnt / "tier") if n.startswith(".tmp")] == []
    _spill(st, pool, 0)
    assert _kept(mnt / "tier") == set()
    st.close()


# ---------------------------------------------------------------- the engine over a restart


@pytest.mark.parametrize("eviction", ["lru", pytest.param("value", marks=pytest.mark.slow)])
def test_a_conversation_read_back_before_a_restart_outlives_a_fill(eviction, tmp_path):
    """A and B written; after a restart A is read back (its next turn); after another, C fills the budget: B's
    records go, A's stay, and A's turn is again >= 95% from disk (lru), equal to its cold twin."""
    layout, d = "runs", str(tmp_path / "tier")
    kw = dict(cache_layout=layout, cache_disk=d, eviction=eviction)
    rng = random.Random(11)
    a1, b1, c1 = random_tokens(rng, 700), random_tokens(rng, 700), random_tokens(rng, 500)
    llm = make_llm(**kw)
    a2 = a1 + run(llm, [a1])[0].outputs[0].token_ids + random_tokens(rng, 150)
    run(llm, [b1])
    llm.close()
    llm = make_llm(**kw)
    read_back = run(llm, [a2])[0].num_cached_tokens
    assert read_back >= 640  # A read back
    llm.close()
    budget = llm.engine.stats().disk_bytes  # what A and B take: C must evict
    llm = make_llm(cache_disk_bytes=budget, **kw)
    run(llm, [c1])
    llm.close()
    assert llm.engine.stats().disk_evictions > 0
    llm = make_llm(cache_disk_bytes=budget, **kw)
    out = run(llm, [a2])[0]
    llm.engine.memory.check_integrity()
    llm.close()
    # lru keeps all of A (its turn-2 tail is newer than B); value may trade A's cheaper checkpoints (its decode one)
    # for B's records, keeping A's head (a restart that forgot the values lost all of A: 0 cached)
    want = 0.95 * len(a2) if eviction == "lru" else 640
    assert out.num_cached_tokens >= want and llm.engine.stats().disk_hit_tokens >= want
    assert signature(out) == _cold(layout, [a2])[0]


# ---------------------------------------------------------------- a server in its own process


def test_a_directory_that_cannot_be_read_is_refused_with_one_line(tmp_path):
    """`deltaserve serve --cache-disk DIR` exits non-zero with one line naming DIR, before loading the model. As
    root (who reads any directory) the server runs without the capabilities that let it."""
    import shutil as sh
    import subprocess
    import sys

    d = tmp_path / "tier"
    d.mkdir()
    os.chmod(d, 0)
    cmd = [sys.executable, "-m", "deltaserve.server", "--port", "1", "--cache-disk", str(d)]
    if os.geteuid() == 0:
        if not sh.which("setpriv"):
            pytest.skip("as root, a directory root cannot read needs setpriv to drop CAP_DAC_*")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.chmod(d, 0o700)
    assert r.returncode != 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"deltaserve serve: --cache-disk {d} cannot be read: Permission denied"], r.stderr[-2000:]


def _complete(base: str, prompt) -> tuple[list, list, int]:
    import httpx

    r = httpx.post(base + "/v1/completions", json={"model": "deltaserve/tiny", "prompt": list(prompt), "max_tokens": 8,
                                                   "temperature": 0, "logprobs": 5, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    lp = body["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _cold_text(prompt):
    """The cold run's tokens (as text pieces) and logprobs, from an engine without a disk tier."""
    llm = make_llm(kv_cache_memory=96 * (1 << 20), cache_layout="runs")
    c = run(llm, [prompt])[0].outputs[0]
    pieces = [llm.engine.tokenizer.id_to_piece(t) for t in c.token_ids]
    return c.token_ids, [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)], pieces


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_server_on_a_read_only_or_full_file_system_serves(fault, small_tmpfs):
    """The server starts on a directory it cannot write (a read-only mount holding last run's records, or a disk
    already full), says so in one line, answers every request as a cold server does, and leaves no temp file."""
    from server_support import RealServer

    mnt, remount = small_tmpfs
    d = mnt / "tier"
    rng, p1 = _session(3, 300)
    if fault == "read-only":
        remount("size=16m")
        llm = make_llm(cache_layout="runs", cache_disk=str(d))
        p2 = p1 + run(llm, [p1])[0].outputs[0].token_ids + random_tokens(rng, 50)
        llm.close()
        remount("ro")
    else:
        p2 = p1
        _fill(mnt)
    srv = RealServer("--cache-disk", str(d), "--cache-layout", "runs", "--seed", "0")
    try:
        tokens, lps, cached = _complete(srv.base, p2)
    finally:
        srv.stop()
    _, cold_lps, _ = _cold_text(p2)
    assert lps == cold_lps and len(tokens) == 8
    assert (cached >= 256) == (fault == "read-only")
    why = "Read-only file system" if fault == "read-only" else "No space left on device"
    assert srv.log().count(f"cannot write ({why})") == 1, srv.log()
    assert not [n for n in os.listdir(d) if n.startswith(".tmp")]


def test_the_fingerprint_names_a_quantized_head_as_the_embedding():
    """A head quantized with --quantize-head is a tied model's embedding too: its fingerprint says so, unlike the
    bf16-head one and unlike a record of an engine whose lookups read a bf16 table beside the quantized head (the
    "quantize_head": "fp8" of earlier versions), so such records are misses, not restored states of another model."""
    from deltaserve.embedded.model import ensure_model
    from deltaserve.runner.disk_store import fingerprint

    class Pool:
        block_size, page_bytes, group_size, pages_per_state = 64, 4096, 2, 1

    path = ensure_model("tiny")
    plain, fp8 = (fingerprint(path, "bfloat16", Pool, "runs", "amx", head, "cpu") for head in ("none", "fp8"))
    assert plain["quantize_head"] == "none" and fp8["quantize_head"] not in ("none", "fp8")
    assert "embedding" in fp8["quantize_head"]
