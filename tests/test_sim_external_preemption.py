"""The external replay when the KV pool fills: vLLM V1's preemption (recompute; the last-admitted running request
goes; its prefix comes back through the prefix cache) and its full-sequence admission rule, on a tiny trace
traced by hand.

Setup: a 6-block pool of 16 tokens, prefix caching on, a synchronous loop, budget 128, two requests of 40 prompt
tokens and 20 outputs arriving together. The schedule vLLM V1 makes, step by step:

  step 1      A and B prefill 40 tokens each (3 blocks each: the pool is full) and sample their first token
  steps 2-9   both decode (positions 40..47 fit their third block)
  step 10     A, first in the running list, needs a 4th block for position 48: nothing is free, so the last
              admitted running request, B, is preempted (its 3 blocks freed; the full ones stay cached, freed tail
              first so the tail is evicted first) and A takes B's tail block. No admission in a step that preempted.
  steps 11-20 A decodes alone; B (40 + 9 tokens, 4 blocks) waits: its first 2 blocks are still cached, but
              taking them pins 2 evictable blocks, so it needs 4 allocatable and has 2 (full-sequence admission)
  step 20     A samples its 20th token and finishes
  step 21     B is readmitted with its cached 32 tokens and recomputes the other 17 (prompt and generated tokens
              alike, by prefill) and samples its 10th token
  steps 22-31 B decodes its last 10 tokens
"""
from __future__ import annotations

import pytest
from test_sim_external import LLAMA

from deltaserve.sim.external_compare import pool_bytes
from deltaserve.sim.external_replay import ExternalRequest, ForeignEngine, decoder_model_config, replay


class StepLog:
    """Logs each step's (prefill (length, start) spans, decodes) and takes 1 ms a step."""

    def __init__(self):
        self.steps = []

    def shape_us(self, s, now=0.0, tokens=None, gathered=None):
        self.steps.append((sorted(s.prefill), len(s.decode_ctx)))
        return 1000.0


def build(blocks: int, budget: int, reserve_full_isl: bool = True):
    mc = decoder_model_config(LLAMA)
    eng = ForeignEngine(max_num_seqs=4, max_num_batched_tokens=budget, block_size=16, enable_prefix_caching=True,
                        async_scheduling=False, reserve_full_isl=reserve_full_isl)
    shape, sched = eng.build(mc, pool_bytes(mc, blocks, 16), mc.dtype)
    assert shape.pool.num_pages == blocks
    return sched


def test_preemption_matches_the_hand_traced_vllm_schedule():
    sched = build(6, 128)
    a = ExternalRequest(0, 0.0, tuple(range(100, 140)), 20)
    b = ExternalRequest(1, 0.0, tuple(range(200, 240)), 20)
    log = StepLog()
    recs, st = replay(sched, log, [a, b], async_scheduling=False)
    want = ([([(40, 0), (40, 0)], 0)] + [([], 2)] * 8 + [([], 1)] * 11 + [([(17, 32)], 0)] + [([], 1)] * 10)
    assert log.steps == want
    assert st["preemptions"] == 1 and st["peak_kv_pages"] == 6
    assert (recs[0].preemptions, recs[1].preemptions) == (0, 1)
    assert recs[0].first_token == recs[1].first_token == pytest.approx(0.001)
    assert recs[0].finish == pytest.approx(0.020) and recs[1].finish == pytest.approx(0.031)
    assert recs[1].output_tokens == 20  # the token sampled again at step 21 is its 10th, not an extra one


def test_full_sequence_admission():
    """A 40-token prompt and a 70-token one in 6 blocks: the second needs 5 blocks for its whole prompt and 3 are
    left, so vLLM holds it until the first finishes; admitting on the first chunk (16 tokens, 1 block) would run
    both prefills in step 1."""
    a = ExternalRequest(0, 0.0, tuple(range(100, 140)), 2)
    c = ExternalRequest(1, 0.0, tuple(range(300, 370)), 2)
    log = StepLog()
    replay(build(6, 64), log, [a, c], async_scheduling=False)
    assert log.steps[:3] == [([(40, 0)], 0), ([], 1), ([(64, 0)], 0)]
    log = StepLog()
    replay(build(6, 64, reserve_full_isl=False), log, [a, c], async_scheduling=False)
    assert log.steps[0] == ([(16, 0), (40, 0)], 0)
