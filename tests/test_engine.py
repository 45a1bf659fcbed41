"""Engine foundation gates: chunked == unchunked, paged == contiguous, concurrent == solo,
preempted == uninterrupted, bad input refused while other requests carry on."""
from __future__ import annotations

import random

import pytest

from deltaserve import SamplingParams
from deltaserve.engine.inputs import EngineInputError

from util import greedy, make_llm, random_tokens, run, signature


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [random_tokens(rng, n) for n in (1, 63, 64, 65, 200, 300, 700)]


def test_chunked_equals_unchunked(prompts):
    whole = make_llm(enable_prefix_caching=False, max_num_batched_tokens=4096)
    on_grid = make_llm(enable_prefix_caching=False, max_num_batched_tokens=64)
    off_grid = make_llm(enable_prefix_caching=False, max_num_batched_tokens=100)
    ref = [signature(o) for o in run(whole, prompts)]
    assert [signature(o) for o in run(on_grid, prompts)] == ref  # bit-identical logprobs on the 64 grid
    assert [signature(o)[0] for o in run(off_grid, prompts)] == [r[0] for r in ref]  # greedy-identical


def test_paged_equals_contiguous_and_concurrent_equals_solo(prompts):
    llm = make_llm(enable_prefix_caching=False)
    solo = [signature(run(llm, [p])[0]) for p in prompts]
    # a fresh engine allocates pages in order (a contiguous run); after churn the free list is scattered
    rng = random.Random(2)
    run(llm, [random_tokens(rng, rng.randrange(50, 400)) for _ in range(12)], params=greedy(max_tokens=3))
    together = [signature(o) for o in run(llm, prompts)]
    assert [t[0] for t in together] == [s[0] for s in solo]  # tokens never depend on the batch
    assert together == solo  # and here the logprobs are bit-identical too


def test_preempted_equals_uninterrupted():
    rng = random.Random(3)
    prompts = [random_tokens(rng, 200 + 40 * i) for i in range(6)]
    params = greedy(max_tokens=120, logprobs=None)
    big = make_llm(enable_prefix_caching=False)
    ref = [signature(run(big, [p], params=params)[0])[0] for p in prompts]
    # 8 pages of 128 tokens cannot hold six ~400-token sequences at once
    small = make_llm(enable_prefix_caching=False, kv_cache_memory=_budget_for_pages(small_pages=10), max_num_seqs=6)
    outs = run(small, prompts, params=params)
    assert small.engine.stats().preemptions > 0
    assert [signature(o)[0] for o in outs] == ref
    assert small.engine.stats().pages_used == 0 and small.engine.stats().slots_used == 0


def _budget_for_pages(small_pages: int, layout: str = "in-page") -> int:
    from deltaserve.config import ModelConfig
    from deltaserve.embedded.model import ensure_model
    from deltaserve.memory.layouts import layout_for
    from deltaserve.memory.sizing import geometry, hybrid_block_size, size_pool

    mc = ModelConfig.from_path(ensure_model("tiny"))
    g = geometry(mc, "bfloat16", "bfloat16", "float32")
    p = size_pool(g, 1 << 30, layout_for(layout).page_tokens(64, hybrid_block_size(g, 64)), 6, layout)
    return 6 * p.slot_bytes + small_pages * p.bytes_per_page


def test_max_tokens_beyond_the_context_is_clamped_unless_strict():
    from deltaserve.engine.inputs import check_request

    params = check_request([5, 6], SamplingParams(max_tokens=100), vocab_size=50, max_model_len=64)
    assert params.max_tokens == 62
    assert check_request([5, 6], SamplingParams(max_tokens=62), 50, 64, strict_max_tokens=True).max_tokens == 62
    with pytest.raises(EngineInputError, match="maximum context length is 64 tokens") as e:
        check_request([5, 6], SamplingParams(max_tokens=63), 50, 64, strict_max_tokens=True)
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    with pytest.raises(EngineInputError, match="leaves no room"):
        check_request([5] * 64, SamplingParams(max_tokens=1), 50, 64)


def test_max_output_tokens_caps_every_budget():
    """--max-output-tokens lowers any larger budget (an unset one included) and leaves a smaller one alone; the
    caller's params are not changed."""
    from deltaserve.engine.inputs import check_request

    asked = SamplingParams(max_tokens=32000)
    assert check_request([5, 6], asked, 50, 64, max_output_tokens=8).max_tokens == 8 and asked.max_tokens == 32000
    assert check_request([5, 6], SamplingParams(max_tokens=None), 50, 64, max_output_tokens=8).max_tokens == 8
    assert check_request([5, 6], SamplingParams(max_tokens=3), 50, 64, max_output_tokens=8).max_tokens == 3
    assert check_request([5, 6], SamplingParams(max_tokens=40), 50, 64, True, max_output_tokens=100).max_tokens == 40


def test_bad_input_refused_and_others_carry_on():
    llm = make_llm()
    eng = llm.engine
    good = random_tokens(random.Random(4), 150)
    eng.add_request("good", {"prompt_token_ids": good}, greedy(max_tokens=6))
    bad = [
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [1] * (eng.max_model_len + 1)}, SamplingParams(), "maximum context length"),
        ({"prompt_token_ids": [eng.model_config.vocab_size + 5]}, SamplingParams(), "out of range"),
        ({"prompt_token_ids": [5, 6]}, SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
    ]
    for i, (prompt, params, needle) in enumerate(bad):
        with pytest.raises(EngineInputError, match=needle):
            eng.add_request(f"bad{i}", prompt, params)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["good"] and len(done[0].outputs[0].token_ids) == 6
    assert eng.stats().pages_used == 0


def test_abort_frees_everything():
    llm = make_llm()
    eng = llm.engine
    rng = random.Random(5)
    for i in range(4):
        eng.add_request(f"r{i}", {"prompt_token_ids": random_tokens(rng, 300)}, greedy(max_tokens=50))
    for _ in range(3):
        eng.step()
    for i in range(4):
        eng.abort_request(f"r{i}")
    assert not eng.has_unfinished_requests()
    assert eng.stats().pages_used == 0 and eng.stats().slots_used == 0


def test_stop_strings_and_tokens():
    llm = make_llm()
    p = random_tokens(random.Random(6), 40)
    free = run(llm, [p], params=greedy(max_tokens=12, logprobs=None))[0].outputs[0]
    tok = free.token_ids[5]
    o = run(llm, [p], params=greedy(max_tokens=12, logprobs=None, stop_token_ids=[tok]))[0].outputs[0]
    assert o.token_ids[-1] == tok and o.finish_reason == "stop" and o.stop_reason == tok
    text = free.text
    if len(text) >= 6:
        stop = text[3:6]
        o = run(llm, [p], params=greedy(max_tokens=12, logprobs=None, stop=[stop]))[0].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == stop and stop not in o.text
        assert text.startswith(o.text)


def test_generate_api_shapes():
    llm = make_llm()
    outs = llm.generate(["Hello there", [5, 6, 7], {"prompt": "Hi"}], SamplingParams(max_tokens=4, n=2, seed=7),
                        use_tqdm=False)
    assert len(outs) == 3 and all(len(o.outputs) == 2 for o in outs)
    assert all(len(c.token_ids) <= 4 for o in outs for c in o.outputs)
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(chat) == 1
    o = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, prompt_logprobs=2), use_tqdm=False)[0]
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == 3 and all(o.prompt_logprobs[1:])


def test_cli_refuses_a_bad_flag_with_a_message_not_a_traceback(capsys):
    from deltaserve.cli import main

    assert main(["generate", "--prompt", "hi", "--prefill-merge-tokens", "-1"]) == 2
    assert "--prefill-merge-tokens must be >= 0" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs must be >= 1" in capsys.readouterr().err


def _poisoned(eng, poison: str | None = None, fail_steps: tuple[int, ...] = (), after: bool = False):
    """Make the runner raise on every step that holds `poison`, and on the steps numbered in fail_steps;
    after=True raises once the step has run (K/V written, GDN slots advanced in place)."""
    execute, calls = eng.runner.execute, [0]

    def run_step(plan):
        calls[0] += 1
        out = execute(plan) if after else None
        if calls[0] in fail_steps or any(w.request_id == poison for w in plan.work):
            raise RuntimeError("injected kernel failure")
        return out if after else execute(plan)
    eng.runner.execute = run_step


def _drive(eng, prompts: dict[str, list[int]], max_tokens: int = 6):
    for rid, p in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, greedy(max_tokens=max_tokens))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        eng.memory.check_integrity()
    return done


@pytest.mark.parametrize("caching", [True, False])
def test_a_failing_request_is_isolated_and_the_others_finish_as_if_nothing_happened(caching):
    rng = random.Random(8)
    prompts = {rid: random_tokens(rng, n) for rid, n in (("a", 300), ("bad", 150), ("c", 90))}
    clean = _drive(make_llm(enable_prefix_caching=caching).engine, prompts)
    eng = make_llm(enable_prefix_caching=caching).engine
    _poisoned(eng, poison="bad")
    done = _drive(eng, prompts)
    assert done["bad"].outputs[0].finish_reason == "abort"
    assert "injected kernel failure" in done["bad"].outputs[0].stop_reason
    for rid in ("a", "c"):  # recomputed after the failed steps: the very same tokens and logprobs
        assert done[rid].outputs[0].finish_reason == "length"
        assert signature(done[rid]) == signature(clean[rid])
    assert eng.step_failures == 2 and eng.stats().pages_used == 0 and eng.stats().slots_used == 0


@pytest.mark.parametrize("after", [False, True])
def test_a_transient_step_failure_loses_nothing(after):
    """Also when the step failed after advancing the GDN slots in place: the requests recompute, not resume."""
    rng = random.Random(9)
    prompts = {f"r{i}": random_tokens(rng, 120 + 40 * i) for i in range(3)}
    clean = _drive(make_llm().engine, prompts)
    eng = make_llm().engine
    _poisoned(eng, fail_steps=(3,), after=after)  # a decode step with all three in it
    done = _drive(eng, prompts)
    assert eng.step_failures == 1
    assert {rid: signature(o) for rid, o in done.items()} == {rid: signature(o) for rid, o in clean.items()}
