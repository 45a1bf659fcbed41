"""Images through the engine: placeholders expanded, the encoder run once per request, the prefix cache keyed by
image content (same image hits, another image of the same size hits only the blocks before it), a hit
bit-identical to a cold run, chunked prefill across an image, and the refusals (the image limit, bad data)
leaving nothing held. A small multimodal model: the tiny preset's text model with a small vision tower."""
from __future__ import annotations

import base64
import json
import random

import pytest
from util import greedy, png, random_tokens, signature

from deltaserve import LLM
from deltaserve.engine.inputs import EngineInputError
from deltaserve.presets import text_preset

IMG, START, END = 4000, 4001, 4002
VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 256,
          "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 64,
          "in_channels": 3, "hidden_act": "gelu_pytorch_tanh"}
# 8-pixel steps, 8x8 to 64x64 pixels: a 448x448 image becomes 8 x 8 tokens, a 97x203 one 5 x 11 (resized to 40x88)
PROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
             "size": {"shortest_edge": 64, "longest_edge": 64 * 64}}


def multimodal_config() -> dict:
    text = text_preset("tiny")
    text["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
            "vision_config": VISION, "image_token_id": IMG, "vision_start_token_id": START,
            "vision_end_token_id": END, "video_token_id": 4003, "tie_word_embeddings": True, "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from deltaserve.model.make import make_random_model
    from deltaserve.text.tokenizer import write_tokenizer

    path = tmp_path_factory.mktemp("tiny-vl")
    write_tokenizer(str(path))
    make_random_model(multimodal_config(), str(path), seed=0)
    with open(path / "preprocessor_config.json", "w") as f:
        json.dump(PROCESSOR, f)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, kv_cache_memory=64 << 20, max_num_seqs=4, max_num_batched_tokens=512, seed=0,
               limit_mm_per_prompt='{"image": 16, "video": 0}')


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def image_prompt(rng, images: int, text: int = 30) -> list[int]:
    """text, then per image <start> <pad> <end> and some text."""
    ids = random_tokens(rng, text)
    for _ in range(images):
        ids += [START, IMG, END] + random_tokens(rng, 20)
    return ids


def gen(llm, ids, images, salt=None, **kw):
    req = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    if salt is not None:
        req["cache_salt"] = salt
    return llm.generate([req], greedy(**kw), use_tqdm=False)[0]


def held(llm) -> tuple[int, int, int]:
    e = llm.engine
    return len(e.runner.media), len(e._live), e.memory.num_slots_in_use


def test_placeholders_expand_and_encoder_runs_once(llm):
    rng = random.Random(1)
    ids = image_prompt(rng, 2)
    runs = llm.engine.runner.media.encoder_runs
    out = gen(llm, ids, [png(448, 448, 1), data_url(png(97, 203, 2))], max_tokens=6)
    assert len(out.outputs[0].token_ids) == 6
    n = out.prompt_token_ids.count(IMG)  # each single placeholder widened to its image's token count
    assert n == len(out.prompt_token_ids) - len(ids) + 2 and n > 64
    assert llm.engine.runner.media.encoder_runs == runs + 1  # one encoder run for both images, the whole request
    assert held(llm) == (0, 0, 0)


def test_requests_with_the_same_images_share_one_encoder_run(llm):
    """Live requests with the same images (n choices, or different prompts around the same pictures) encode
    them once; each one's tokens and logprobs are what it gets alone, and nothing is held after."""
    rng = random.Random(12)
    imgs = [png(448, 448, 70), png(97, 203, 71)]
    prompts = [image_prompt(rng, 2) for _ in range(3)]
    media = llm.engine.runner.media
    runs = media.encoder_runs
    reqs = [{"prompt_token_ids": q, "multi_modal_data": {"image": imgs}, "cache_salt": f"share-{k}"}
            for k, q in enumerate(prompts)]
    together = llm.generate(reqs, greedy(max_tokens=6), use_tqdm=False)
    assert media.encoder_runs == runs + 1 and held(llm) == (0, 0, 0) and not media._shared
    alone = [gen(llm, q, imgs, salt=f"alone-{k}", max_tokens=6) for k, q in enumerate(prompts)]
    assert media.encoder_runs == runs + 4
    assert [signature(o) for o in together] == [signature(o) for o in alone]
    n3 = llm.generate([{"prompt_token_ids": prompts[0], "multi_modal_data": {"image": imgs}, "cache_salt": "n3"}],
                      greedy(max_tokens=4, n=3), use_tqdm=False)[0]
    assert len(n3.outputs) == 3 and media.encoder_runs == runs + 5  # n = 3: one encoder run


def test_image_changes_the_output(llm):
    rng = random.Random(2)
    ids = image_prompt(rng, 1)
    a = gen(llm, ids, [png(448, 448, 10)], salt="a", max_tokens=12)
    b = gen(llm, ids, [png(448, 448, 11)], salt="b", max_tokens=12)
    assert signature(a) != signature(b)


def test_same_image_hits_other_image_does_not(llm):
    rng = random.Random(3)
    ids = random_tokens(rng, 300) + [START, IMG, END] + random_tokens(rng, 200)  # the image past block 2
    a, b = png(448, 448, 20), png(448, 448, 21)  # same size: same placeholder tokens
    first = gen(llm, ids, [a], salt="s")
    again = gen(llm, ids, [a], salt="s")
    other = gen(llm, ids, [b], salt="s")
    bs = llm.engine.block_size
    image_at = 301
    assert again.num_cached_tokens > image_at + 64  # past the image
    assert other.num_cached_tokens <= image_at // bs * bs  # only the blocks before the image
    assert signature(again) == signature(first)
    cold = gen(llm, ids, [b], salt="cold")
    assert signature(other) == signature(cold)


def test_next_turn_hit_equals_cold(llm):
    """A conversation with images, re-sent with a new turn: the hit's tokens and logprobs are a cold run's."""
    rng = random.Random(4)
    imgs = [png(448, 448, 30), png(97, 203, 31), png(250, 40, 32)]
    turn1 = image_prompt(rng, 3, text=140)
    out1 = gen(llm, turn1, imgs, salt="conv", max_tokens=10)
    turn2 = turn1 + out1.outputs[0].token_ids + random_tokens(rng, 90) + [START, IMG, END] + random_tokens(rng, 40)
    imgs2 = imgs + [png(64, 64, 33)]
    hit = gen(llm, turn2, imgs2, salt="conv", max_tokens=10)
    cold = gen(llm, turn2, imgs2, salt="cold-conv", max_tokens=10)
    assert hit.num_cached_tokens >= len(out1.prompt_token_ids) // llm.engine.block_size * llm.engine.block_size - \
        llm.engine.block_size
    assert hit.num_cached_tokens > 0 and cold.num_cached_tokens == 0
    assert signature(hit) == signature(cold)


def test_chunked_prefill_across_an_image(model_dir, llm):
    """Prefill chunks of 128 tokens (ends inside images) give the one-chunk run's tokens and logprobs."""
    rng = random.Random(5)
    ids = image_prompt(rng, 3, text=100)
    imgs = [png(448, 448, 40), png(448, 448, 41), png(97, 203, 42)]
    whole = gen(llm, ids, imgs, salt="whole", max_tokens=8)
    small = LLM(model=model_dir, kv_cache_memory=64 << 20, max_num_seqs=4, max_num_batched_tokens=128, seed=0)
    try:
        chunked = gen(small, ids, imgs, salt="chunked", max_tokens=8)
    finally:
        small.close()
    assert signature(chunked) == signature(whole)


def test_refusals_hold_nothing(llm):
    rng = random.Random(6)
    with pytest.raises(EngineInputError, match="at most 16 images"):
        gen(llm, image_prompt(rng, 17, text=5), [png(16, 16, k) for k in range(17)])
    with pytest.raises(EngineInputError, match="base64"):
        gen(llm, image_prompt(rng, 1), ["data:image/png;base64,@@not base64@@"])
    with pytest.raises(EngineInputError, match="not a readable image"):
        gen(llm, image_prompt(rng, 1), [data_url(b"not an image at all")])
    with pytest.raises(EngineInputError, match="remote image URLs"):
        gen(llm, image_prompt(rng, 1), ["https://example.com/cat.png"])
    with pytest.raises(EngineInputError, match="2 image placeholder"):
        gen(llm, image_prompt(rng, 2), [png(32, 32, 1)])
    assert held(llm) == (0, 0, 0)
    llm.engine.memory.check_integrity()


def test_block_hashes_carry_the_images_in_them():
    """Only the blocks holding an image's placeholders carry its hash; the chain carries it on."""
    from deltaserve.memory.hashing import block_hash
    from deltaserve.scheduler.request import Request

    ids = list(range(10, 74)) + [IMG] * 64 + list(range(200, 264))  # block 0 text, block 1 the image, block 2 text
    a = Request("a", ids, 4, media=((64, 64, b"A" * 32),))
    b = Request("b", ids, 4, media=((64, 64, b"B" * 32),))
    text = Request("t", ids, 4)
    ha, hb, ht = (r.block_hashes(3, 64) for r in (a, b, text))
    assert ha[0] == hb[0] == ht[0]  # the text before the image
    assert len({ha[1], hb[1], ht[1]}) == 3 and ha[2] != hb[2]  # the image's block, and every block after
    assert ha[1] == block_hash(ha[0], ids[64:128], False, (b"A" * 32,))
    assert a.block_media(0, 64) == () and a.block_media(1, 64) == (b"A" * 32,) and a.block_media(2, 64) == ()
    two = Request("c", ids, 4, media=((60, 8, b"X" * 32), (70, 4, b"Y" * 32)))
    assert two.block_media(0, 64) == (b"X" * 32,) and two.block_media(1, 64) == (b"X" * 32, b"Y" * 32)


def test_preemption_keeps_the_encoder_output(model_dir):
    """A pool too small for every request at once: requests with images are preempted and recompute (through
    the prefill path, their images' rows from the stored encoder output), the encoder still runs once per
    request, and the greedy tokens equal each request run without interruption."""
    from deltaserve.config import ModelConfig
    from deltaserve.memory.layouts import layout_for
    from deltaserve.memory.sizing import geometry, hybrid_block_size, size_pool

    g = geometry(ModelConfig.from_path(model_dir), "bfloat16", "bfloat16", "float32")
    p = size_pool(g, 1 << 30, layout_for("in-page").page_tokens(64, hybrid_block_size(g, 64)), 4, "in-page")
    rng = random.Random(8)
    prompts = [image_prompt(rng, 2, text=150) for _ in range(4)]
    imgs = [[png(448, 448, 50 + k), png(97, 203, 60 + k)] for k in range(4)]
    reqs = [{"prompt_token_ids": q, "multi_modal_data": {"image": im}} for q, im in zip(prompts, imgs)]
    params = greedy(max_tokens=100, logprobs=None)
    big = LLM(model=model_dir, kv_cache_memory=64 << 20, max_num_seqs=4, seed=0, enable_prefix_caching=False)
    try:
        ref = [o.outputs[0].token_ids for o in (big.generate([r], params, use_tqdm=False)[0] for r in reqs)]
    finally:
        big.close()
    small = LLM(model=model_dir, kv_cache_memory=4 * p.slot_bytes + 8 * p.bytes_per_page, max_num_seqs=4, seed=0,
                enable_prefix_caching=False)  # 8 pages of 128 tokens for four ~500-token sequences
    try:
        together = small.generate(reqs, params, use_tqdm=False)
        assert small.engine.stats().preemptions > 0
        assert small.engine.runner.media.encoder_runs == 4 and len(small.engine.runner.media) == 0
    finally:
        small.close()
    assert [o.outputs[0].token_ids for o in together] == ref


def test_tensor_parallel_serves_the_text_of_a_multimodal_checkpoint(model_dir):
    """Under tensor parallelism the ranks load the text model of a multimodal checkpoint (the vision tower
    is not sharded): text requests run, a request with images is a 400 that says why."""
    llm = LLM(model=model_dir, tensor_parallel_size=2, kv_cache_memory=32 << 20, max_num_seqs=2, seed=0)
    try:
        out = llm.generate([{"prompt_token_ids": list(range(10, 60))}], greedy(max_tokens=4), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        with pytest.raises(EngineInputError, match="tensor parallelism"):
            gen(llm, image_prompt(random.Random(9), 1), [png(32, 32, 0)])
    finally:
        llm.engine.shutdown()


def test_cache_hints_move_with_the_widened_placeholders():
    """A hint (a position in the prompt the client sent, one placeholder per image) lands on the same place after
    each placeholder run is widened to its image's tokens; one inside a run lands on its image's first token."""
    from deltaserve.engine.images import PromptImages

    # ids: 0..4 text, a 1-token run at 5, text 6..9, a 4-token run (already wide) at 10, text after
    p = PromptImages(token_ids=[], images=[], grids=[(2, 3), (2, 2)], offsets=[5, 15], runs=((5, 1), (10, 4)))
    assert p.widen((3, 5, 6, 9, 10, 12, 14, 20)) == (3, 5, 11, 14, 15, 15, 19, 25)


def test_processed_image_cache_hit_is_the_processors_output(model_dir, llm):
    """An image sent again is one digest: the engine's processed-image cache hands back what the processor (the
    reference) makes of those bytes, bit for bit, and the request's output is the first one's; another image of
    the same size misses; the same picture as bytes instead of a data URL is another key, with the same hash."""
    import numpy as np

    from deltaserve.media.images import ImagePreprocessor, open_image

    cache = llm.engine.image_cache
    rng = random.Random(13)
    ids = image_prompt(rng, 1)
    raw = png(448, 448, 80)
    hits, misses = cache.hits, cache.misses
    first = gen(llm, ids, [data_url(raw)], salt="pc-1", max_tokens=6)
    assert (cache.hits, cache.misses) == (hits, misses + 1)
    again = gen(llm, ids, [data_url(raw)], salt="pc-2", max_tokens=6)
    assert (cache.hits, cache.misses) == (hits + 1, misses + 1)
    assert signature(again) == signature(first)
    got = cache.get(cache.key(data_url(raw)))
    ref = ImagePreprocessor(model_dir)(open_image(raw))
    assert got.grid == ref.grid and got.num_tokens == ref.num_tokens and got.hash == ref.hash
    assert got.pixels.dtype == ref.pixels.dtype and np.array_equal(got.pixels, ref.pixels)
    other = png(448, 448, 81)  # same size, other pixels: another key, another content hash
    gen(llm, ids, [data_url(other)], salt="pc-3", max_tokens=2)
    assert cache.misses == misses + 2  # the lookup above hit
    assert cache.get(cache.key(data_url(other))).hash != ref.hash
    assert cache.key(raw) != cache.key(data_url(raw)) != cache.key(base64.b64encode(raw).decode())
    gen(llm, ids, [raw], salt="pc-4", max_tokens=2)  # bytes: a miss, processed to the same content hash
    assert cache.get(cache.key(raw)).hash == ref.hash
    assert held(llm) == (0, 0, 0)


def test_processed_image_cache_keeps_refusals_out(llm):
    """A refused image is refused again the same way: nothing of it was cached."""
    cache = llm.engine.image_cache
    rng = random.Random(14)
    bad = data_url(b"not an image at all")
    n = len(cache)
    for _ in range(2):
        with pytest.raises(EngineInputError, match="not a readable image"):
            gen(llm, image_prompt(rng, 1), [bad])
    assert len(cache) == n and cache.key(bad) not in cache


def test_processed_image_cache_is_lru_within_its_budget(model_dir):
    """Least recently used out first, never over the budget; an entry over the whole budget is not kept; a
    budget of 0 keeps nothing; prepare_images with the cache gives prepare_images without it."""
    import numpy as np

    from deltaserve.engine.images import prepare_images
    from deltaserve.media.images import ImagePreprocessor, ProcessedImageCache, open_image

    proc = ImagePreprocessor(model_dir)
    raws = [png(448, 448, 90 + k) for k in range(4)]  # 64 tokens each: 256 patches of 96 floats
    size = ProcessedImageCache.size_of(proc(open_image(raws[0])))
    cache = ProcessedImageCache(3 * size)
    ids = [1, 2, START, IMG, END, 3]
    ref = [prepare_images(ids, [r], proc, IMG, 16) for r in raws]
    for r in raws[:3]:
        prepare_images(ids, [r], proc, IMG, 16, cache)
    assert len(cache) == 3 and cache.bytes == 3 * size and (cache.hits, cache.misses) == (0, 3)
    assert cache.get(cache.key(raws[0])) is not None  # raws[0] is now the most recent
    got = prepare_images(ids, [raws[3]], proc, IMG, 16, cache)  # over the budget: raws[1] goes
    assert cache.evictions == 1 and cache.bytes <= cache.budget_bytes
    assert cache.key(raws[1]) not in cache and all(cache.key(raws[k]) in cache for k in (0, 2, 3))
    for k in (0, 2, 3):  # hits and the fresh processing agree
        hit = prepare_images(ids, [raws[k]], proc, IMG, 16, cache)
        assert hit.token_ids == ref[k].token_ids and hit.media_keys == ref[k].media_keys
        assert np.array_equal(hit.images[0].pixels, ref[k].images[0].pixels)
    assert got.media_keys == ref[3].media_keys
    small = ProcessedImageCache(size - 1)
    small.put(small.key(raws[0]), ref[0].images[0])
    assert len(small) == 0 and small.bytes == 0
    off = ProcessedImageCache(0)
    prepare_images(ids, [raws[0]], proc, IMG, 16, off)
    assert len(off) == 0 and off.get(off.key(raws[0])) is None
    assert ProcessedImageCache.key(object()) is None  # a PIL image (no encoded form) is not cached
