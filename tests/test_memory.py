"""The memory manager on small scripted scenarios with pinned page ids, plus a randomized integrity test."""
from __future__ import annotations

import random
import sys

import pytest

from deltaserve.config import ConfigError
from deltaserve.memory import CheckpointError, MemoryManager, OutOfPagesError, block_hash, root_hash

BS = 4


def keys(tokens, salt=None, bs=BS):
    """(root, [(hash, parent, tokens)] for every full block)."""
    root = parent = root_hash(salt)
    out = []
    for j in range(len(tokens) // bs):
        t = tuple(tokens[j * bs:(j + 1) * bs])
        h = block_hash(parent, t)
        out.append((h, parent, t))
        parent = h
    return root, out


def lookup(m, tokens, salt=None):
    root, ks = keys(tokens, salt, m.block_size)
    nb = (len(tokens) - 1) // m.block_size
    return m.find_prefix(root, [k[0] for k in ks], lambda j: ks[j][2], nb)


def compute(m, sid, tokens, upto, salt=None, save=True):
    """Allocate pages for positions [0, upto), plan a save at upto if it is a boundary, 'run', publish, commit."""
    new = m.append_pages(sid, upto)
    loc = m.reserve_checkpoint(sid, upto) if save and upto % m.block_size == 0 else None
    _, ks = keys(tokens[:upto], salt, m.block_size)
    m.publish(sid, ks[m.num_published(sid):])
    m.commit_checkpoints(sid)
    m.check_integrity()
    return new, loc


T1 = list(range(1, 11))  # 10 tokens: blocks [1..4], [5..8], partial [9, 10]


def test_no_torch_import():
    import subprocess
    out = subprocess.run([sys.executable, "-c", "import sys, deltaserve.memory, deltaserve.scheduler; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_allocation_publish_and_release_order():
    m = MemoryManager(8, 2, BS, 2, caching=True, layout="in-page")
    assert m.admit("a") == (0, None)  # no hit: the caller zeroes slot 0
    new, loc = compute(m, "a", T1, 8)
    assert new == [0, 1] and loc == (2, 3)  # checkpoint of block 1: one page per GDN group
    assert m.append_pages("a", 10) == [4]  # the partial third block
    assert m.page_table("a") == (0, 1, 4)
    u = m.usage()
    assert (u.pages_used, u.pages_cached, u.pages_free, u.slots_used) == (5, 0, 3, 1)
    m.free("a")
    m.check_integrity()
    # uncached page 4 goes to the free list; cached pages to the LRU: tail block first, checkpoint last
    assert m.free_page_ids() == (5, 6, 7, 4)
    assert list(m._evictor) == [1, 0, 2, 3]
    assert m.usage().pages_used == 0 and m.num_free_slots == 2


def test_hit_restores_and_backs_off():
    m = MemoryManager(8, 2, BS, 2, caching=True, layout="in-page")
    m.admit("a")
    compute(m, "a", T1, 4)  # checkpoint of block 0 in (1, 2)
    compute(m, "a", T1, 8)  # checkpoint of block 1 in (4, 5); (1, 2) released to the LRU
    assert m.page_table("a") == (0, 3)
    m.free("a")
    hit = lookup(m, T1)
    assert (hit.num_blocks, hit.page_ids, hit.checkpoint, hit.num_tokens) == (2, (0, 3), (4, 5), 8)
    # the whole sequence cached: back off one block so one token is left to compute
    back = lookup(m, T1[:8])
    assert (back.num_blocks, back.checkpoint) == (1, (1, 2))
    assert lookup(m, T1[:4]).num_blocks == 0
    assert m.pin_cost(hit) == 4
    slot, loc = m.admit("b", hit)
    assert (slot, loc) == (1, (4, 5))  # restore location -> slot 1
    assert m.page_table("b") == (0, 3) and m.stats.checkpoints_restored == 1
    assert m.append_pages("b", 10) == [6]  # free list first (6, 7), evictable pages after
    m.check_integrity()
    m.free("b")
    m.check_integrity()


def test_lru_eviction_order_and_invalidation():
    m = MemoryManager(8, 2, BS, 1, caching=True, layout="in-page")
    m.admit("a")
    compute(m, "a", T1, 8)  # pages 0, 1; checkpoint (2,)
    m.free("a")
    assert m.free_page_ids() == (3, 4, 5, 6, 7) and list(m._evictor) == [1, 0, 2]
    m.admit("b")
    assert m.append_pages("b", 20) == [3, 4, 5, 6, 7]  # the free list before any eviction
    assert lookup(m, T1).num_blocks == 2
    assert m.append_pages("b", 24) == [1]  # evicts the tail block: its entry and checkpoint go with it
    assert m.stats.evictions == 2 and m.free_page_ids() == (2,)
    assert lookup(m, T1).num_blocks == 0  # block 1 gone, block 0 has no checkpoint
    assert m.append_pages("b", 28) == [2]
    assert m.append_pages("b", 32) == [0]
    assert m.num_cached_blocks() == 0 and m.num_allocatable() == 0
    with pytest.raises(OutOfPagesError):
        m.append_pages("b", 36)
    m.check_integrity()


def test_evicting_a_checkpoint_keeps_the_block():
    m = MemoryManager(6, 2, BS, 1, caching=True, layout="in-page")
    m.admit("a")
    compute(m, "a", T1, 4)  # page 0, checkpoint (1,)
    compute(m, "a", T1, 8)  # page 2, checkpoint (3,); (1,) released
    assert list(m._evictor) == [1]
    m.admit("b")
    assert m.append_pages("b", 12) == [4, 5, 1]  # evicts the older checkpoint only
    assert m.num_cached_blocks() == 2 and m.stats.evictions == 1
    m.free("a")
    assert lookup(m, T1).num_blocks == 2  # the latest checkpoint was held by "a", so it survived
    assert lookup(m, T1[:8]).num_blocks == 0  # block 0 lost its checkpoint
    m.check_integrity()


def test_replaced_checkpoints_never_hit_are_evicted_first():
    m = MemoryManager(12, 3, BS, 1, caching=True, layout="in-page")
    m.admit("old")
    compute(m, "old", [9] * 10, 4)  # page 0, checkpoint (1,)
    m.free("old")  # LRU: 0, 1
    m.admit("a")
    compute(m, "a", T1, 4)  # page 2, checkpoint (3,)
    compute(m, "a", T1, 8)  # page 4, checkpoint (5,); (3,) replaced, never hit: low value
    assert list(m._evictor) == [3, 0, 1]
    m.admit("b", lookup(m, T1[:8]))  # hits block 0: its checkpoint (3,) is proven useful
    compute(m, "b", T1, 8)  # b's duplicate of block 1 (page 6), its own checkpoint (7,) dropped
    m.free("b")  # (3,) released again, now in LRU order; b's duplicate page is uncached
    assert list(m._evictor) == [0, 1, 3]
    compute(m, "a", T1 + [11, 12], 12)  # page 6 ... a's (5,) replaced, never hit
    assert list(m._evictor)[0] == 5
    m.check_integrity()


def test_a_prompt_checkpoint_replaced_by_a_decode_keeps_its_place():
    """The prompt's checkpoint, replaced when a decode completes a block, is what the conversation's next turn
    resumes from (it re-sends the outputs as prompt tokens, hashed apart from this request's output blocks): it
    is released in LRU order, not as low value."""
    m = MemoryManager(12, 3, BS, 1, caching=True, layout="in-page")
    m.admit("old")
    compute(m, "old", [9] * 10, 4)  # page 0, checkpoint (1,)
    m.free("old")  # LRU: 0, 1
    m.admit("a")
    m.append_pages("a", 4)
    m.reserve_checkpoint("a", 4, "prompt")  # page 2, the prompt's checkpoint (3,)
    m.publish("a", keys(T1[:4])[1])
    m.commit_checkpoints("a")
    compute(m, "a", T1, 8)  # a decode completes block 1: its STEP checkpoint (5,) replaces (3,)
    assert list(m._evictor) == [0, 1, 3]
    compute(m, "a", T1 + [11, 12], 12)  # a STEP checkpoint replaced by another, never hit: low value
    assert list(m._evictor)[0] == 5
    m.check_integrity()


@pytest.mark.parametrize("kind", ["fork", "declared", "structural", "learned"])
def test_fork_and_resume_point_checkpoints_replaced_keep_their_place(kind):
    """A fork checkpoint (a second sequence shares the prefix it ends) and a resume point (declared, structural or
    learned: a later request is expected to resume there) are taken for a later request: replaced by the sequence's
    next checkpoint before anyone hit them, they are released in LRU order like the prompt's, not as low value."""
    m = MemoryManager(12, 3, BS, 1, caching=True, layout="in-page")
    m.admit("old")
    compute(m, "old", [9] * 10, 4)  # page 0, checkpoint (1,)
    m.free("old")  # LRU: 0, 1
    m.admit("a")
    m.append_pages("a", 8)  # pages 2, 3
    m.reserve_checkpoint("a", 4, kind)  # (4,): inside the chunk
    m.reserve_checkpoint("a", 8, "step")  # (5,): the chunk's end replaces it
    m.publish("a", keys(T1[:8])[1])
    m.commit_checkpoints("a")
    assert list(m._evictor) == [0, 1, 4]
    m.check_integrity()


def test_a_junction_is_renewed_by_the_hits_that_pass_it():
    """A checkpoint two requests resumed from (a shared prefix's end, where sessions part) moves to the young end of
    the eviction order whenever a deeper hit passes it, as that hit's attention pages do; one read once (a turn's
    end, read by the next turn) keeps its place, so a long conversation does not keep one checkpoint per turn."""
    m = MemoryManager(24, 4, BS, 1, caching=True, layout="in-page")
    S = [1, 2, 3, 4]  # the shared prefix: one block
    B, C = S + [5, 6, 7, 8, 9], S + [15, 16, 17, 18, 19]  # two sessions parting after it
    m.admit("a")
    m.append_pages("a", 4)  # page 0
    m.reserve_checkpoint("a", 4, "declared")  # (1,)
    m.publish("a", keys(S)[1])
    m.commit_checkpoints("a")
    m.free("a")
    for sid, T in (("b", B), ("c", C)):  # each resumes from (1,): two reads make it a junction
        m.admit(sid, lookup(m, T))
        compute(m, sid, T, 8)  # b: page 2, checkpoint (3,); c: page 4, checkpoint (5,)
        m.free(sid)
    assert list(m._evictor) == [2, 3, 1, 4, 0, 5]
    D = B + [10, 11, 12, 13]  # b's next turn: resumes from (3,), passing (1,)
    hit = lookup(m, D)
    assert (hit.num_blocks, hit.checkpoint) == (2, (3,))
    m.admit("d", hit)
    assert list(m._evictor) == [4, 5, 1]  # without the renewal (1,) would go first: [1, 4, 5]
    assert m.stats.checkpoints_renewed == 1
    compute(m, "d", D, 12)  # page 6, checkpoint (7,)
    m.free("d")
    assert list(m._evictor) == [4, 5, 1, 3, 6, 2, 0, 7]
    E = D + [20, 21, 22, 23, 24]  # passes (1,), read three times, and (3,), read once
    m.admit("e", lookup(m, E))
    assert list(m._evictor) == [4, 5, 3, 1]  # (1,) renewed, (3,) kept its place
    assert m.stats.checkpoints_renewed == 2
    m.check_integrity()


@pytest.mark.parametrize("layout", ["in-page", "per-block"])
def test_salt_isolation(layout):
    m = MemoryManager(16, 3, BS, 2, caching=True, layout=layout)
    m.admit("a")
    compute(m, "a", T1, 8, salt="alice")
    m.free("a")
    assert lookup(m, T1, "alice").num_blocks == 2
    for salt in (None, "", "bob", "alice "):
        assert lookup(m, T1, salt).num_blocks == 0
    assert root_hash(None) != root_hash("")


def test_hit_compares_tokens_not_only_hashes():
    m = MemoryManager(8, 2, BS, 1, caching=True, layout="in-page")
    m.admit("a")
    compute(m, "a", T1, 8)
    m.free("a")
    root, ks = keys(T1)
    forged = [tuple(t + 100 for t in k[2]) for k in ks]
    hit = m.find_prefix(root, [k[0] for k in ks], lambda j: forged[j], 2)
    assert hit.num_blocks == 0
    wrong_root = m.find_prefix(root_hash("x"), [k[0] for k in ks], lambda j: ks[j][2], 2)
    assert wrong_root.num_blocks == 0


def test_per_block_layout_checkpoint_is_the_attention_page():
    m = MemoryManager(6, 2, BS, 3, caching=True, layout="per-block")
    assert m.checkpoint_pages == 0 and m.max_request_tokens() == 24
    m.admit("a")
    new, loc = compute(m, "a", T1, 8)
    assert new == [0, 1] and loc == (1,)  # the state of block 1 lives at index 1 of the state tensor
    m.free("a")
    hit = lookup(m, T1)
    assert (hit.num_blocks, hit.page_ids, hit.checkpoint) == (2, (0, 1), (1,))
    m.admit("b")
    assert m.append_pages("b", 20) == [2, 3, 4, 5, 1]  # evicting page 1 drops block 1 and its state
    assert lookup(m, T1).num_blocks == 0
    m.check_integrity()


def test_runs_layout_checkpoint_spans_pages_per_group():
    """runs: a checkpoint is pages_per_state pages per GDN group, location[g * k + j] owned by group g;
    they are taken, cached, hit and evicted together."""
    m = MemoryManager(16, 2, BS, 2, caching=True, layout="runs", pages_per_state=3)
    assert m.checkpoint_pages == 6 and m.max_request_tokens() == (16 - 12) * BS
    m.admit("a")
    new, loc = compute(m, "a", T1, 8)
    assert new == [0, 1] and loc == (2, 3, 4, 5, 6, 7)
    assert [m._kind[q] for q in loc] == [0, 0, 0, 1, 1, 1]
    m.free("a")
    hit = lookup(m, T1)
    assert (hit.num_blocks, hit.page_ids, hit.checkpoint) == (2, (0, 1), loc)
    assert m.pin_cost(hit) == 8
    slot, restore = m.admit("b", hit)
    assert restore == loc
    m.free("b")
    m.admit("c")
    # b released page 1 first (the page table in reverse), so LRU takes it first: block 1 leaves the cache,
    # and its checkpoint's six pages go back to the free list with it
    assert m.append_pages("c", 4 * 9) == [8, 9, 10, 11, 12, 13, 14, 15, 1]
    assert lookup(m, T1).num_blocks == 0 and set(loc) <= set(m.free_page_ids())
    m.check_integrity()
    with pytest.raises(ConfigError):
        MemoryManager(16, 2, BS, 2, caching=True, layout="in-page", pages_per_state=2)


def test_zeroing_plans_only_new_attention_pages():
    m = MemoryManager(12, 2, BS, 2, caching=True, layout="in-page")
    m.admit("a")
    compute(m, "a", T1, 8)
    m.free("a")
    hit = lookup(m, T1)
    slot, loc = m.admit("b", hit)
    new = m.append_pages("b", 10)
    assert loc is not None and set(new).isdisjoint(hit.page_ids) and set(new).isdisjoint(loc)
    assert new == [4]


def test_fail_closed():
    m = MemoryManager(12, 2, BS, 2, caching=True, layout="in-page")
    m.admit("a")
    m.append_pages("a", 8)
    for end in (0, 3, 6, 10, 12):  # not block ends, or past the page table
        with pytest.raises(CheckpointError):
            m.reserve_checkpoint("a", end)
    m.reserve_checkpoint("a", 4, "grid")  # inside the chunk being computed
    m.reserve_checkpoint("a", 8)
    for end in (4, 8):
        with pytest.raises(CheckpointError):
            m.reserve_checkpoint("a", end)  # twice
    with pytest.raises(ValueError):
        m.reserve_checkpoint("a", 4, "whim")
    with pytest.raises(CheckpointError):
        m.publish("a", [(b"h", b"p", (1, 2, 3))])  # a partial block
    _, ks = keys(T1)
    m.publish("a", ks)
    m.commit_checkpoints("a")
    with pytest.raises(CheckpointError):
        m.reserve_checkpoint("a", 4)  # a block already published
    m.free("a")
    hit = lookup(m, T1)
    m.admit("c")
    m.append_pages("c", 4 * 10)  # evicts everything cached
    with pytest.raises(CheckpointError):
        m.admit("b", hit)  # a stale hit is refused, not served
    m.free("c")
    off = MemoryManager(12, 2, BS, 2, caching=False, layout="in-page")
    off.admit("a")
    off.append_pages("a", 8)
    with pytest.raises(CheckpointError):
        off.reserve_checkpoint("a", 8)
    assert lookup(off, T1).num_blocks == 0


def test_caching_off_has_no_cache():
    m = MemoryManager(4, 1, BS, 2, caching=False, layout="in-page")
    assert m.max_request_tokens() == 16
    m.admit("a")
    assert m.append_pages("a", 16) == [0, 1, 2, 3]
    m.publish("a", keys(list(range(16)))[1])  # a no-op with caching off
    m.free("a")
    assert m.free_page_ids() == (3, 2, 1, 0) and m.num_cached_blocks() == 0
    m.check_integrity()


def test_config_errors():
    with pytest.raises(ConfigError):
        MemoryManager(4, 1, BS, 2, caching=True, layout="in-page")  # cannot hold 1 block + 2 checkpoints
    with pytest.raises(ConfigError):
        MemoryManager(8, 1, BS, 2, caching=True, layout="sideways")
    assert MemoryManager(5, 1, BS, 2, caching=True).max_request_tokens() == 4


def test_duplicates_republished_when_the_winner_is_evicted():
    m = MemoryManager(12, 2, BS, 1, caching=True, layout="in-page")
    m.admit("a")
    m.admit("b")
    compute(m, "a", T1, 8)  # a wins blocks 0, 1: pages 0, 1, checkpoint (2,)
    new, loc = compute(m, "b", T1, 8)  # b computes duplicates: pages 3, 4; its checkpoint (5,) dropped
    assert new == [3, 4] and loc == (5,)
    assert m.free_page_ids()[-1] == 5  # b holds a's checkpoint instead
    m.free("a")
    m.admit("c")
    # the free pages, then a's blocks (evicted; b still holds checkpoint 2)
    assert m.append_pages("c", 4 * 9) == [6, 7, 8, 9, 10, 11, 5, 1, 0]
    assert lookup(m, T1).num_blocks == 0
    m.free("b")  # b's duplicates are published in their place, with the orphaned checkpoint
    hit = lookup(m, T1)
    assert (hit.num_blocks, hit.page_ids, hit.checkpoint) == (2, (3, 4), (2,))
    m.check_integrity()


class _Driver:
    """Random valid use of the manager, as a scheduler would: admit (with hits), grow, save, publish, free."""

    def __init__(self, seed: int, layout: str, caching: bool, eviction=None):
        self.rng = random.Random(seed)
        G = self.rng.randint(0, 3)
        k = 3 if layout == "runs" else 1  # pages per state
        self.m = MemoryManager(self.rng.randint(1 + 2 * G * k, 30 + 2 * G * k), self.rng.randint(1, 4), BS, G,
                               caching, layout, eviction, pages_per_state=k)
        self.seqs: dict[str, dict] = {}
        self.n = 0
        prefixes = [[self.rng.randint(1, 9) for _ in range(self.rng.randint(0, 20))] for _ in range(3)]
        self.prefixes = prefixes

    def step(self) -> None:
        rng, m = self.rng, self.m
        op = rng.random()
        if op < 0.3 and m.num_free_slots:
            self.n += 1
            sid = f"s{self.n}"
            toks = rng.choice(self.prefixes) + [rng.randint(1, 9) for _ in range(rng.randint(1, 30))]
            salt = rng.choice([None, "x"])
            hit = lookup(m, toks, salt) if m.caching else None
            if m.pin_cost(hit) + 1 > m.num_allocatable():
                return
            m.admit(sid, hit)
            self.seqs[sid] = {"toks": toks, "salt": salt, "done": hit.num_tokens if hit else 0}
        elif op < 0.8 and self.seqs:
            sid = rng.choice(sorted(self.seqs))
            s = self.seqs[sid]
            if s["done"] >= len(s["toks"]):
                s["toks"].append(rng.randint(1, 9))
            bs = m.block_size
            end = min(len(s["toks"]), (s["done"] // bs + rng.randint(1, 3)) * bs)
            save = m.caching and m.num_gdn_groups and end % bs == 0
            if m.pages_needed(sid, end) + (m.checkpoint_pages if save else 0) > m.num_allocatable():
                m.free(sid)
                del self.seqs[sid]
                return
            m.append_pages(sid, end)
            if save:
                m.reserve_checkpoint(sid, end)
            m.check_integrity()
            if rng.random() < 0.1:  # freed before its step "ran"
                m.free(sid)
                del self.seqs[sid]
                return
            s["done"] = end
            _, ks = keys(s["toks"][:end], s["salt"], bs)
            m.publish(sid, ks[m.num_published(sid):])
            m.commit_checkpoints(sid)
        elif self.seqs:
            sid = rng.choice(sorted(self.seqs))
            m.free(sid)
            del self.seqs[sid]
        m.check_integrity()

    def finish(self) -> None:
        for sid in list(self.seqs):
            self.m.free(sid)
        self.m.check_integrity()
        u = self.m.usage()
        assert u.pages_used == 0 and u.slots_used == 0
        assert u.pages_free + u.pages_cached == u.pages_total


@pytest.mark.parametrize("layout", ["in-page", "runs", "per-block"])
@pytest.mark.parametrize("caching", [True, False])
def test_randomized_integrity(layout, caching):
    for seed in range(12):
        d = _Driver(seed, layout, caching)
        for _ in range(300):
            d.step()
        d.finish()


def test_value_eviction_takes_what_spares_least_first():
    """ValueEviction pops the lowest priority (L + value), low-value pages first, ties in release order, and
    inflates L to what it evicted (recency); the engine's names match the policies."""
    from deltaserve.config import EVICTIONS
    from deltaserve.memory.eviction import EVICTION_POLICIES, ValueEviction

    assert set(EVICTIONS) == set(EVICTION_POLICIES)
    v = ValueEviction()
    v.push(1, value=64.0)
    v.push(2, value=8.0)
    v.push(3, low_value=True, value=500.0)
    v.push(4, value=64.0)
    assert list(v) == [3, 2, 1, 4] and len(v) == 4 and 2 in v
    v.remove(2)
    assert v.pop() == 3 and v.pop() == 1
    v.push(5, value=10.0)  # released after an eviction at priority 64: 64 + 10, behind page 4 (64)
    assert list(v) == [4, 5] and v.pop() == 4 and v.pop() == 5 and len(v) == 0


@pytest.mark.parametrize("layout", ["in-page", "runs", "per-block"])
def test_value_eviction_under_pressure_keeps_integrity(layout):
    from deltaserve.memory.eviction import ValueEviction

    for seed in range(4):
        d = _Driver(seed, layout, True, eviction=ValueEviction())
        for _ in range(300):
            d.step()
        d.finish()
        assert d.m.stats.evictions > 0 or seed, "the pressure run evicts"


def test_mutant_evicting_a_held_page_is_caught():
    """An eviction policy that hands back a page someone holds: the manager refuses it (fail closed)."""
    from deltaserve.memory.eviction import LRUEviction

    class Careless(LRUEviction):
        def pop(self) -> int:
            return held[0]

    m = MemoryManager(6, 2, BS, 1, caching=True, layout="in-page", eviction=Careless())
    m.admit("c")  # one published block, freed: its page is cached, evictable
    m.append_pages("c", 4)
    m.publish("c", keys(list(range(1, 5)))[1])
    m.free("c")
    m.admit("a")
    held = m.append_pages("a", 4 * 5)  # the pool's free pages, all of them
    assert not m.free_page_ids() and m.num_allocatable() == 1
    m.admit("b")
    with pytest.raises(AssertionError):
        m.append_pages("b", 4)  # needs the evictable page: the careless policy offers one of a's instead
