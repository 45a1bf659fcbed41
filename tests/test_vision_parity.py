"""Parity of the multimodal model with transformers' Qwen3_5ForConditionalGeneration: the same random weights
(written by transformers' save_pretrained, read by load_model), prompts with 1, 4 and 16 images (square and
odd sizes) preprocessed by the same image processor; logits match within the text model's fp32 tolerance, and
in bf16 within its bf16 tolerance against transformers' own bf16 run.
Plus the parts against their plain-torch references: the position-table resampling, M-RoPE positions
against get_rope_index, and M-RoPE cos / sin against transformers' recomposition."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deltaserve.media.images import ImagePreprocessor
from deltaserve.model.batch import ForwardBatch
from deltaserve.model.loader import load_model
from deltaserve.model.mrope import ImageSpan, mrope_cos_sin, mrope_cos_sin_reference, positions
from deltaserve.model.ops.attention import RotaryTable, rotary_inv_freq
from deltaserve.model.vision import pos_embed, pos_embed_reference
from deltaserve.runner.media import RequestMedia
from model_driver import make_caches

IMAGE, START, END = 250, 251, 252  # image pad, vision start, vision end in the small vocabulary
TEXT = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 5,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [3, 3, 2], "mrope_interleaved": True}}
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 64,
          "in_channels": 3, "hidden_act": "gelu_pytorch_tanh"}
# the processor at this patch size: 8-pixel grid steps, 8x8 .. 64x64 pixels (1 .. 64 tokens an image)
PROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
             "size": {"shortest_edge": 8 * 8, "longest_edge": 64 * 64}}


def _randomize(model, seed: int) -> None:
    from test_parity import randomize

    randomize(model.model.language_model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):  # LayerNorm scales around 1
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "merger.linear_fc2" in name:  # image embeddings the size of the token embeddings (0.25)
                p.copy_(0.25 * torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif "pos_embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import transformers as tf

    cfg = tf.Qwen3_5Config(text_config=dict(TEXT), vision_config=dict(VISION), image_token_id=IMAGE,
                           vision_start_token_id=START, vision_end_token_id=END, video_token_id=253,
                           tie_word_embeddings=True)
    hf = tf.Qwen3_5ForConditionalGeneration(cfg).eval()
    _randomize(hf, seed=11)
    path = tmp_path_factory.mktemp("qwen3_5_vl")
    hf.save_pretrained(path)
    ours = load_model(str(path), dtype="float32")
    assert ours.visual is not None
    ours.checkpoint = str(path)  # the bf16 test loads it again
    return hf, ours


def _image(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (max(h // 7, 2), max(w // 7, 2), 3), dtype=np.uint8)  # smooth-ish content
    return Image.fromarray(base).resize((w, h), Image.BILINEAR)


def _prompt(sizes, seed):
    """Token ids with each image as <start> <pad>*n <end> between random text, the processed images, and the
    image spans."""
    proc = ImagePreprocessor(overrides=PROCESSOR)
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, 240, (n,), generator=g).tolist()
    ids, images, spans = text(5), [], []
    for k, (h, w) in enumerate(sizes):
        p = proc(_image(h, w, seed * 100 + k))
        gh, gw = proc.merged_grid(p)
        ids.append(START)
        spans.append(ImageSpan(len(ids), gh, gw))
        ids += [IMAGE] * p.num_tokens
        ids.append(END)
        ids += text(1 + k % 3)
        images.append(p)
    return ids, images, spans


def _ours(model, ids, images, spans, chunks=None):
    media = RequestMedia(spans, [torch.from_numpy(p.pixels) for p in images], [p.grid for p in images])
    pages = -(-len(ids) // 64) + 1
    caches = make_caches(model, num_slots=1, num_pages=pages, block_size=64)
    out, pos = [], 0
    for n in chunks or [len(ids)]:
        batch = ForwardBatch.build([(ids[pos:pos + n], pos, 0, list(range(pages)), False, (),
                                     media.span_media(model.visual, pos, n))])
        with torch.inference_mode():
            out.append(model.compute_logits(model.forward(batch, caches)))
        pos += n
    assert media.encodes == 1  # once per request, whatever the chunks
    return torch.cat(out), media


def _hf(hf, ids, images, perturb: float = 0.0):
    """transformers' logits; perturb > 0: its image embeddings scaled by 1 + perturb * noise (seeded) first."""
    t = torch.tensor([ids])
    px = torch.from_numpy(np.concatenate([p.pixels for p in images]))
    grid = torch.tensor([p.grid for p in images])
    with torch.no_grad():
        if not perturb:
            return hf(input_ids=t, pixel_values=px, image_grid_thw=grid, mm_token_type_ids=(t == IMAGE).int()).logits[0]
        emb = hf.model.visual(px, grid_thw=grid).pooler_output
        emb = emb * (1 + perturb * torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)))
        pos, _ = hf.model.get_rope_index(t, mm_token_type_ids=(t == IMAGE).int(), image_grid_thw=grid)
        x = hf.model.language_model.embed_tokens(t)
        x[t == IMAGE] = emb
        return hf.lm_head(hf.model.language_model(inputs_embeds=x, position_ids=pos).last_hidden_state)[0]


@pytest.mark.parametrize("sizes", [[(448, 448)], [(448, 448), (97, 203), (33, 61), (250, 40)],
                                   [(448, 448), (97, 203), (33, 61), (250, 40)] * 4],
                         ids=["1-image", "4-images", "16-images"])
def test_logits_match_transformers(pair, sizes):
    """The encoder's output within 1e-5 of transformers' (fp32 rounding); the logits within the text model's
    1e-4, or within twice what transformers' own logits move when its image embeddings move by one part in
    a million (fp32 rounding of the encoder, as the 1e-5 above): these random weights amplify a perturbation
    of the input embeddings several hundred times, so that is the resolution any fp32 reimplementation has."""
    hf, ours = pair
    ids, images, spans = _prompt(sizes, seed=len(sizes))
    ref = _hf(hf, ids, images)
    got, media = _ours(ours, ids, images, spans)
    with torch.no_grad():
        enc = hf.model.visual(torch.from_numpy(np.concatenate([p.pixels for p in images])),
                              grid_thw=torch.tensor([p.grid for p in images])).pooler_output
    assert (media.embeds - enc).abs().max().item() <= 1e-5
    assert got.shape == ref.shape and ref.abs().max() > 1.0
    sensitivity = (_hf(hf, ids, images, perturb=1e-6) - ref).abs().max().item()
    diff = (got - ref).abs().max().item()
    print(f"{len(sizes)} images, {len(ids)} tokens: max |logit diff| {diff:.2e}, transformers' sensitivity {sensitivity:.2e}")
    assert diff <= max(1e-4, 2 * sensitivity), f"{len(sizes)} images: max abs diff {diff} (sensitivity {sensitivity})"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def _rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()


@pytest.fixture(scope="module")
def bf16_pair(pair):
    """transformers' model cast to bf16 (its own bf16 run: the floor) and ours loaded in bf16 from the checkpoint."""
    import copy

    hf, ours = pair
    return copy.deepcopy(hf).to(torch.bfloat16), load_model(ours.checkpoint, dtype="bfloat16")


@pytest.mark.parametrize("sizes", [[(448, 448)], [(448, 448), (97, 203), (33, 61), (250, 40)],
                                   [(448, 448), (97, 203), (33, 61), (250, 40)] * 4],
                         ids=["1-image", "4-images", "16-images"])
def test_bf16_logits_match_transformers(pair, bf16_pair, sizes):
    """bf16, the text model's stated bf16 tolerance (docs/fp8.md, docs/images.md): against transformers' fp32
    logits (the reference), ours in bf16 are no further off (relative RMS) than 1.25x transformers' own bf16
    run, the bf16 noise floor of these weights; ours against transformers' bf16 stays within 2x that floor and
    under 0.1; the argmax agrees with fp32's as often as transformers' bf16 one does (within 0.05: the random
    logits of 256 tokens have near ties that bf16 flips either way). Two bf16 computations round in different
    places, so they are not the same bits."""
    hf, _ = pair
    hf16, ours16 = bf16_pair
    ids, images, spans = _prompt(sizes, seed=len(sizes))
    ref = _hf(hf, ids, images)
    theirs = _hf(hf16, ids, images).float()
    got, _ = _ours(ours16, ids, images, spans)
    floor, err, apart = _rel_rms(theirs, ref), _rel_rms(got, ref), _rel_rms(got, theirs)
    agree, their_agree = ((x.argmax(-1) == ref.argmax(-1)).float().mean().item() for x in (got, theirs))
    print(f"bf16, {len(sizes)} images, {len(ids)} tokens: relative RMS vs fp32 ours {err:.4f}, transformers' "
          f"{floor:.4f}; ours vs transformers' bf16 {apart:.4f}; argmax agreement with fp32 ours {agree:.3f}, "
          f"transformers' {their_agree:.3f}")
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert 0 < floor and err <= 1.25 * floor, f"ours {err} vs fp32, transformers' bf16 {floor}"
    assert apart <= min(2 * floor, 0.1), f"ours vs transformers' bf16 {apart} (floor {floor})"
    assert agree >= their_agree - 0.05  # argmax: a few ties near the top flip either way in bf16


def test_chunks_across_an_image_match(pair):
    """A prefill cut inside images (off and on the 64 grid) matches the one-chunk logits; the encoder ran once."""
    _, ours = pair
    ids, images, spans = _prompt([(448, 448), (97, 203)], seed=7)
    whole, _ = _ours(ours, ids, images, spans)
    cut = spans[0].offset + 10
    chunked, _ = _ours(ours, ids, images, spans, chunks=[cut, 64 - cut, len(ids) - 64])
    assert (chunked - whole).abs().max().item() <= 1e-4


def test_bf16_chunks_on_the_grid_inside_an_image_are_bit_identical(pair):
    """bf16: a prefill cut on the 64 grid inside an image gives the one-chunk logits bit for bit (the rule
    chunked prefill keeps, docs/design.md), and the logits stay near the fp32 model's (same argmax almost
    everywhere: bf16 rounding)."""
    hf, ours = pair
    bf16 = load_model(ours.checkpoint, dtype="bfloat16")
    ids, images, spans = _prompt([(448, 448), (97, 203)], seed=9)
    assert spans[0].offset < 64 < spans[0].end  # the cut at 64 falls inside the first image
    whole, _ = _ours(bf16, ids, images, spans)
    chunked, _ = _ours(bf16, ids, images, spans, chunks=[64, len(ids) - 64])
    assert torch.equal(chunked, whole)
    ref, _ = _ours(ours, ids, images, spans)
    agree = (whole.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"bf16 vs fp32: max |logit diff| {(whole - ref).abs().max().item():.3f}, argmax agreement {agree:.3f}")
    assert agree >= 0.9


def test_decode_after_images_matches_transformers(pair):
    """Generated tokens rotate at index + shift: greedy continuation equals transformers' generate."""
    hf, ours = pair
    ids, images, spans = _prompt([(97, 203), (448, 448)], seed=3)
    t = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.generate(input_ids=t, pixel_values=torch.from_numpy(np.concatenate([p.pixels for p in images])),
                          image_grid_thw=torch.tensor([p.grid for p in images]), mm_token_type_ids=(t == IMAGE).int(),
                          attention_mask=torch.ones_like(t), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False)[0, len(ids):].tolist()
    media = RequestMedia(spans, [torch.from_numpy(p.pixels) for p in images], [p.grid for p in images])
    pages = -(-(len(ids) + 8) // 64)
    caches = make_caches(ours, num_slots=1, num_pages=pages, block_size=64)
    batch = ForwardBatch.build([(ids, 0, 0, list(range(pages)), False, (), media.span_media(ours.visual, 0, len(ids)))])
    with torch.inference_mode():
        new = [int(ours.compute_logits(ours.forward(batch, caches))[-1].argmax())]
        for i in range(7):
            pos = len(ids) + i
            b = ForwardBatch.build([([new[-1]], pos, 0, list(range(pages)), True, (), media.span_media(ours.visual, pos, 1))])
            new.append(int(ours.compute_logits(ours.forward(b, caches))[-1].argmax()))
    assert new == ref


def test_pos_embed_matches_interpolate():
    table = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    for h, w in [(2, 2), (8, 8), (6, 14), (16, 4), (24, 50)]:
        assert torch.allclose(pos_embed(table, h, w, 2), pos_embed_reference(table, h, w, 2), atol=1e-5)


def test_positions_match_get_rope_index(pair):
    hf, _ = pair
    ids, images, spans = _prompt([(448, 448), (97, 203), (33, 61)], seed=5)
    t = torch.tensor([ids])
    ref, delta = hf.model.get_rope_index(t, mm_token_type_ids=(t == IMAGE).int(),
                                         image_grid_thw=torch.tensor([p.grid for p in images]))
    got = torch.tensor(positions(spans, 0, len(ids)))
    assert torch.equal(got, ref[:, 0])
    for a, b in [(0, 7), (7, 40), (spans[1].offset + 3, len(ids))]:  # any chunk, computed on its own
        assert torch.equal(torch.tensor(positions(spans, a, b)), ref[:, 0, a:b])
    from deltaserve.model.mrope import final_shift

    assert final_shift(spans) == int(delta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_cos_sin_matches_transformers_formula(dtype):
    inv = rotary_inv_freq(16, 10000.0)
    pos3 = torch.stack([torch.arange(40), torch.arange(40) * 3 % 17, torch.arange(40) * 5 % 23])
    got = mrope_cos_sin(RotaryTable(inv, dtype), pos3, (3, 3, 2))
    ref = mrope_cos_sin_reference(pos3, inv, (3, 3, 2), dtype)
    for g, r in zip(got, ref):
        assert torch.allclose(g.float(), r.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    text = torch.arange(40).expand(3, 40)  # text tokens: bit-identical to the plain table
    table = RotaryTable(inv, dtype)
    assert all(torch.equal(a, b) for a, b in zip(mrope_cos_sin(table, text, (3, 3, 2)), table(text[0], 40)))


def test_vision_param_count_is_the_encoders():
    """VisionConfig.num_params (what the planner adds to the weights) counts VisionModel's parameters."""
    from deltaserve.config import VisionConfig
    from deltaserve.model.vision import VisionModel
    from deltaserve.presets import load_preset

    for vc in (VisionConfig.from_hf(load_preset("qwen3.5-0.8b-shape")),
               VisionConfig.from_hf({"model_type": "qwen3_5", "vision_config": VISION, "text_config": TEXT})):
        with torch.device("meta"):
            n = sum(p.numel() for p in VisionModel(vc).parameters())
        assert vc.num_params() == n
