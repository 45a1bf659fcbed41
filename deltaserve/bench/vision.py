"""The image rows of `deltaserve bench throughput` (`--images 4,16`): the vision encoder's throughput and the
time to first token of a prompt with images, cold and hit, over HTTP for every engine and in-process for ours.

Over HTTP (the rows compared across engines; `, HTTP` in their labels): each engine is a server of its own
(`deltaserve serve`, bench/serve.py; llama.cpp's multimodal server, mtmd: llama-server with the vision tower
converted by its own converter to an mmproj GGUF, its prompt cache on), sent the very same Chat Completions bodies
(chat_body: text, each image as a PNG data URL with words after it, then more words than a block, max_tokens 1), in
the same order, the same number of times: a warm-up, then per repeat and image count one cold request (images
never seen) and HIT_PAIRS hits of it. TTFT is the wall time of a request, best of its samples; the note says how
many prompt tokens each server took from its cache (ours: usage's cached_tokens; llama-server: timings.cache_n).

In-process (ours only, the rows without `, HTTP`):

  encoder@S     the vision encoder alone (the model's `visual`), BATCH S x S images a call, as the runner
                calls it (all of a request's images at once): images/s
  ttft@N cold   one request (max_tokens 1) with N S x S images, images never seen: decode, preprocess,
                encode, prefill; seconds from submitting to the first token
  ttft@N hit    the same request again: the prefix cache serves every block up to the text after the last
                image (that text is longer than a block, so every placeholder sits in a cached block), the
                encoder must not run (checked: the runner's encoder-run count), and the token and its
                logprobs must be the cold run's, bit for bit (checked); the processed-image cache
                (--mm-processor-cache-gb) serves every image (checked: its hit count), so the images cost a
                digest each
  ttft@N hit, images reprocessed
                the same hit with the processed-image cache emptied first: every image decoded, preprocessed
                and hashed again (what a hit cost without that cache), the same checks. The two hits
                alternate HIT_PAIRS times after each cold run, each row the best of them (a hit is short
                beside the noise of a shared machine)

The images are seeded random colour blocks (PNG), new ones for every cold run. Each arm is its own engine
(prefix caching on, --limit-mm-per-prompt at the largest N), run one after another after the throughput arms
have closed.
"""
from __future__ import annotations

import io
import json
import random
import time

from .serve import in_process

BATCH = 4  # images per encoder call in the encoder@S row
HIT_PAIRS = 3  # (hit, hit with the images reprocessed) pairs after each cold run; each row keeps its best


def png(size: int, seed: int) -> bytes:
    """A size x size PNG of seeded random colour blocks (something the processor resizes and normalises)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)).resize((size, size))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class ImageArm:
    """deltaserve with prefix caching on and room for `max_images` images a request."""

    name = "deltaserve"
    size = 448  # the images' side (--image-size)

    def __init__(self, model_dir: str, *, max_images: int, max_num_batched_tokens: int, kv_cache_memory: int,
                 lo: int, hi: int):
        self.llm = in_process({"model": model_dir, "dtype": "bfloat16", "kv_cache_memory": kv_cache_memory,
                               "max_num_seqs": 1, "max_num_batched_tokens": max_num_batched_tokens,
                               "enable_prefix_caching": True,
                               "limit_mm_per_prompt": json.dumps({"image": max_images, "video": 0})})
        self.engine = self.llm.engine
        if self.engine.vision is None:
            raise RuntimeError(f"{model_dir} has no vision encoder")
        vc = self.engine.vision_config
        self.ids = vc.vision_start_token_id, vc.image_token_id, vc.vision_end_token_id
        self.lo, self.hi = lo, hi
        self.model_dir = model_dir

    def _text(self, rng: random.Random, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(self.lo, self.hi)
            if t not in self.ids:
                out.append(t)
        return out

    def prompt(self, n_images: int, seed: int) -> tuple[list[int], list[bytes], int]:
        """(ids, images, size): 32 text tokens, then per image its three template tokens and 8 text tokens, then
        a block and 8 tokens of text, so that a hit serves every image's placeholders."""
        rng = random.Random(seed)
        start, pad, end = self.ids
        ids = self._text(rng, 32)
        for _ in range(n_images):
            ids += [start, pad, end] + self._text(rng, 8)
        ids += self._text(rng, self.engine.block_size + 8)
        return ids, [png(self.size, seed * 1000 + k) for k in range(n_images)], self.size

    def encoder(self, n: int, seed: int) -> float:
        """Seconds of one encoder call over n size x size images (preprocessed before the clock starts)."""
        import torch

        from ..media.images import ImagePreprocessor, open_image

        proc = ImagePreprocessor(self.model_dir)
        done = [proc(open_image(png(self.size, seed + k))) for k in range(n)]
        pixels = torch.cat([torch.from_numpy(p.pixels) for p in done])
        grids = [p.grid for p in done]
        with torch.inference_mode():
            t = time.perf_counter()
            self.engine.vision(pixels, grids)
            return time.perf_counter() - t

    def ttft(self, ids: list[int], images: list[bytes]) -> tuple[float, dict]:
        """Seconds to the first token of one request, and what it did: cached tokens, encoder runs, its token
        and logprobs."""
        from ..engine.sampling_params import SamplingParams

        media, images_cache = self.engine.runner.media, self.engine.image_cache
        runs, image_hits = media.encoder_runs, images_cache.hits
        t = time.perf_counter()
        out = self.llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                                SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
        dt = time.perf_counter() - t
        o = out.outputs[0]
        return dt, {"cached": out.num_cached_tokens, "prompt": len(out.prompt_token_ids or ()),
                    "encoder_runs": media.encoder_runs - runs, "image_hits": images_cache.hits - image_hits,
                    "token": list(o.token_ids), "logprobs": repr(o.logprobs)}

    def close(self) -> None:
        self.llm.close()
        self.llm = self.engine = None


HTTP_BLOCK = 128  # the words after the last image: over half this many, so a hit covers every image (blocks <= 128)


def chat_body(n_images: int, seed: int, size: int, block: int = HTTP_BLOCK) -> dict:
    """The Chat Completions body every engine gets: 16 words, each image (a size x size PNG data URL) with 4 words
    after it, then block // 2 + 8 words; greedy, max_tokens 1. No engine-specific field (llama-server caches the
    prompt by default)."""
    import base64

    rng = random.Random(seed)
    words = lambda k: " ".join(f"w{rng.randrange(1000)}" for _ in range(k))  # noqa: E731
    parts = [{"type": "text", "text": words(16)}]
    for k in range(n_images):
        url = "data:image/png;base64," + base64.b64encode(png(size, seed * 1000 + k)).decode()
        parts += [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": words(4)}]
    parts.append({"type": "text", "text": words(block // 2 + 8)})
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 1, "temperature": 0.0}


def http_ttft(server, body: dict) -> tuple[float, dict]:
    """Seconds of one request (its wall time: max_tokens 1), and the prompt tokens it took from the server's cache
    (llama-server's timings.cache_n, else usage.prompt_tokens_details.cached_tokens) of its prompt_tokens."""
    t = time.perf_counter()
    r = server.post("/v1/chat/completions", body)
    dt = time.perf_counter() - t
    usage, timings = r.get("usage") or {}, r.get("timings")
    details = usage.get("prompt_tokens_details") or {}
    cached = timings.get("cache_n", 0) if timings else details.get("cached_tokens", 0)
    return dt, {"cached": int(cached or 0), "prompt": int(usage.get("prompt_tokens", 0))}


def _start_deltaserve(args, grid, progress):
    import os

    from .serve import DeltaserveServer

    progress(f"{grid.preset}: starting deltaserve serve for the image rows over HTTP")
    engine = {"model": grid.model_dir, "dtype": "bfloat16", "kv_cache_memory": grid.kv_cache_memory, "max_num_seqs": 1,
              "max_num_batched_tokens": grid.max_num_batched_tokens, "enable_prefix_caching": True,
              "limit_mm_per_prompt": (("image", max(args.images)), ("video", 0))}
    return DeltaserveServer(engine, os.path.join(args.log_dir, f"deltaserve-{grid.preset}-images.log"))


def _start_llama_cpp(args, grid, progress):
    """llama-server on the checkpoint's bf16 GGUF with its vision tower as an mmproj GGUF (peers/llama_cpp.py
    ensure_mmproj), one slot."""
    import os

    from .peers.llama_cpp import LlamaServer, ensure_gguf, ensure_mmproj

    log = os.path.join(args.log_dir, f"llama.cpp-{os.path.basename(os.path.normpath(grid.model_dir))}-mtmd.log")
    progress("llama.cpp-bf16: converting the checkpoint and its vision tower to GGUF (cached)")
    gguf = ensure_gguf(grid.model_dir, "bf16", root=args.llama_cpp_dir, log_path=log)
    mmproj = ensure_mmproj(grid.model_dir, root=args.llama_cpp_dir, log_path=log)
    return LlamaServer(gguf, ctx=8192 + 256 * max(args.images), slots=1, threads=args.llama_cpp_threads,
                       log_path=log, root=args.llama_cpp_dir, extra=("--mmproj", mmproj))


HTTP_ENGINES = {"deltaserve": _start_deltaserve, "llama.cpp-bf16": _start_llama_cpp}


def measure_http(args, res, grid, progress, engine: str) -> None:
    """The `, HTTP` ttft rows of one engine (HTTP_ENGINES) into res.vision: the same bodies, the same number of
    samples for every engine (module docstring); a server that cannot start, or a request that fails, gets its
    reason in place of the rows."""
    from .peers import PeerUnavailable

    try:
        server = HTTP_ENGINES[engine](args, grid, progress)
    except (PeerUnavailable, OSError, RuntimeError) as e:
        res.vision[(grid.preset, "images, HTTP", engine)] = {"error": str(e)[:300]}
        progress(f"{grid.preset}: {engine}'s server for the image rows could not start: {e}")
        return
    try:
        warm = chat_body(1, 999, args.image_size)
        http_ttft(server, warm)
        http_ttft(server, warm)
        for rep in range(args.repeats):
            for n in sorted(set(args.images)):
                body = chat_body(n, 10_000 * (rep + 1) + n, args.image_size)
                cold_s, cold = http_ttft(server, body)
                hits = [http_ttft(server, body) for _ in range(HIT_PAIRS)]
                hit_s, hit = min(hits, key=lambda h: h[0])
                for label, s, what, k in ((f"ttft@{n} cold, HTTP", cold_s, cold, 1),
                                          (f"ttft@{n} hit, HTTP", hit_s, hit, HIT_PAIRS)):
                    key = (grid.preset, label, engine)
                    if key not in res.vision or s < res.vision[key]["value"]:
                        res.vision[key] = {"value": s, "unit": "s", "note": f"{what['cached']} of {what['prompt']} "
                                           f"prompt tokens from its cache; best of {k * args.repeats} "
                                           f"request{'s' if k * args.repeats > 1 else ''} of the same bodies"}
                progress(f"{grid.preset} {engine} ttft@{n} over HTTP: cold {cold_s:.3f}s, hit {hit_s:.3f}s "
                         f"({hit['cached']} of {hit['prompt']} cached)")
    except Exception as e:  # noqa: BLE001
        res.vision[(grid.preset, "images, HTTP", engine)] = {"error": f"{type(e).__name__}: {e}"[:300]}
        progress(f"{grid.preset}: {engine}'s image rows over HTTP failed: {e}")
    finally:
        server.close()


def measure(args, res, grid, progress) -> None:
    """The in-process image rows of one preset into res.vision: (preset, label, engine) -> {"value", "unit",
    "note"}, best of the repeats (images/s highest, seconds lowest); a row that failed gets its reason."""
    counts = sorted(set(args.images))
    try:
        arm = ImageArm(grid.model_dir, max_images=max(counts), max_num_batched_tokens=grid.max_num_batched_tokens,
                       kv_cache_memory=grid.kv_cache_memory, lo=grid.lo, hi=grid.hi)
    except Exception as e:  # noqa: BLE001
        res.vision[(grid.preset, "images", "deltaserve")] = {"error": f"{type(e).__name__}: {e}"[:300]}
        progress(f"{grid.preset}: the image arm could not start: {e}")
        return
    arm.size = args.image_size
    S = arm.size

    def best(rep: int, label: str, value: float, unit: str, note: str, higher: bool) -> None:
        old = res.vision.get((grid.preset, label, "deltaserve"))
        if old is None or (value > old["value"] if higher else value < old["value"]):
            res.vision[(grid.preset, label, "deltaserve")] = {"value": value, "unit": unit, "note": note}
        res.samples.append({"preset": grid.preset, "row": label, "engine": "deltaserve", "repeat": rep,
                            "tokens": "", "seconds": round(value if unit == "s" else BATCH / value, 4),
                            "tok_s": "", "load1": ""})

    try:
        progress(f"{grid.preset}: warming up the image arm")
        arm.encoder(1, 999)
        warm = arm.prompt(1, 999)[:2]
        for _ in range(2):  # cold, then a hit: an engine's first hit pays once for what later hits reuse
            arm.ttft(*warm)
        for rep in range(args.repeats):
            dt = arm.encoder(BATCH, 100 * rep)
            best(rep, f"encoder@{S}", BATCH / dt, "images/s", f"{BATCH} images a call", True)
            progress(f"{grid.preset} encoder@{S}: {BATCH / dt:.1f} images/s")
            for n in counts:
                ids, images, _ = arm.prompt(n, 10_000 * (rep + 1) + n)
                cold_s, cold = arm.ttft(ids, images)
                hit_s = again_s = float("inf")
                for _ in range(HIT_PAIRS):  # hits are short: alternate the two kinds, keep the best of each
                    s, hit = arm.ttft(ids, images)
                    arm.engine.image_cache.clear()  # the same hit, every image processed again
                    s2, again = arm.ttft(ids, images)
                    hit_s, again_s = min(hit_s, s), min(again_s, s2)
                    for what, h, image_hits in (("hit", hit, n), ("hit, images reprocessed", again, 0)):
                        same = h["token"] == cold["token"] and h["logprobs"] == cold["logprobs"]
                        if h["encoder_runs"] != 0 or not same or h["cached"] == 0 or h["image_hits"] != image_hits:
                            raise AssertionError(f"ttft@{n} {what}: encoder runs {h['encoder_runs']}, cached "
                                                 f"{h['cached']}, processed-image cache hits {h['image_hits']}, "
                                                 f"bit-identical {same}")
                best(rep, f"ttft@{n} cold, in-process", cold_s, "s", f"{cold['prompt']} prompt tokens, encoder ran "
                     f"{cold['encoder_runs']}x", False)
                best(rep, f"ttft@{n} hit, in-process", hit_s, "s", f"{hit['cached']} of {hit['prompt']} tokens cached, encoder ran "
                     f"{hit['encoder_runs']}x, {n} of {n} images from the processed-image cache, token and logprobs "
                     "bit-identical to cold", False)
                best(rep, f"ttft@{n} hit, images reprocessed, in-process", again_s, "s", f"{again['cached']} of {again['prompt']} "
                     f"tokens cached, encoder ran {again['encoder_runs']}x, every image decoded, preprocessed and "
                     "hashed again, token and logprobs bit-identical to cold", False)
                progress(f"{grid.preset} ttft@{n}: cold {cold_s:.3f}s, hit {hit_s:.3f}s ({hit['cached']} cached), "
                         f"hit with the images reprocessed {again_s:.3f}s")
    except Exception as e:  # noqa: BLE001
        res.vision[(grid.preset, "images", "deltaserve")] = {"error": f"{type(e).__name__}: {e}"[:300]}
        progress(f"{grid.preset}: the image rows failed: {e}")
    finally:
        arm.close()


def render(res) -> list[str]:
    """The image rows' table (none without --images): a row per (preset, row, engine), in the order measured."""
    if not res.vision:
        return []
    lines = ["| preset | image row | engine | value | what it did |", "|---|---|---|---|---|"]
    for (preset, label, engine), v in res.vision.items():
        if "error" in v:
            lines.append(f"| {preset} | {label} | {engine} | failed | {v['error']} |")
        elif v["unit"] == "s":
            lines.append(f"| {preset} | {label} | {engine} | {1000 * v['value']:,.0f} ms | {v['note']} |")
        else:
            lines.append(f"| {preset} | {label} | {engine} | {v['value']:,.{1 if v['value'] >= 10 else 2}f} {v['unit']} "
                         f"| {v['note']} |")
    return lines
