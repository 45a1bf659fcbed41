"""What a loaded model and a serving process hold: nothing of the checkpoint stays mapped once the model is up,
the vision encoder is read only while images are on, the planner's weights as run are what the model holds, and
`deltaserve serve`'s peak (VmHWM) and resident (VmRSS) memory after load and one request stay within
1.10 x (weights as run + pool) + 0.8 GB, the planner's resident figure within 10% of the measurement.

The server tests read /proc/PID/status of a real `deltaserve serve` process: the 0.8B shape here, the 4B shape
(9.3 GB bf16, 5 GB block-FP8) under DELTASERVE_SLOW=1."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from deltaserve.bench.peers import free_port
from deltaserve.model.loader import load_model
from deltaserve.model.make import make_random_model
from deltaserve.presets import load_preset
from deltaserve.tools.planner import plan

GB = 10**9
POOL = 1 << 30  # --kv-cache-memory 1G
LINUX = sys.platform.startswith("linux")


def _mapped(path: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if path in line]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from deltaserve.text.tokenizer import write_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-vl"))
    write_tokenizer(path)
    make_random_model(load_preset("tiny"), path)  # the tiny preset has a (small) vision tower
    return path


@pytest.mark.skipif(not LINUX, reason="reads /proc/self/maps")
def test_loaded_model_maps_nothing_of_the_checkpoint(tiny_dir):
    """Every weight lives in memory of its own: no view into a mapping of the safetensors file survives the load
    (a norm weight or a tied embedding left as a view would keep the whole file mapped for the model's life)."""
    model = load_model(tiny_dir)
    assert model.visual is not None
    assert not _mapped(tiny_dir), _mapped(tiny_dir)[:3]


def test_images_off_leaves_the_vision_encoder_unread(tiny_dir):
    """vision=False (the engine's --limit-mm-per-prompt image=0): no encoder, none of its bytes held; the planner
    leaves it out of the weights as run as well."""
    with_images, text_only = load_model(tiny_dir), load_model(tiny_dir, vision=False)
    assert text_only.visual is None and with_images.visual is not None
    held, held_off = with_images.held_weight_bytes(), text_only.held_weight_bytes()
    assert held_off["vision"] == 0 and held["vision"] > 0
    assert held_off["total"] == held["total"] - held["vision"]
    off = plan(tiny_dir, budget_bytes=POOL, limit_mm_per_prompt=(("image", 0),))["serve"]
    assert off["weight_bytes"] == held_off["total"]


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_planner_weights_as_run_are_what_the_model_holds(tmp_path, quantize):
    """`deltaserve plan`'s weights as run (from the safetensors headers) against HybridModel.held_weight_bytes of
    the loaded model: equal for bf16 (packing keeps the bytes), within 1% for block-FP8 (linear_fp8's scales)."""
    make_random_model(load_preset("tiny"), str(tmp_path), quantize=quantize)
    held = load_model(str(tmp_path)).held_weight_bytes()["total"]
    want = plan(str(tmp_path), budget_bytes=POOL)["serve"]["weight_bytes"]
    if quantize is None:
        assert want == held
    else:
        assert abs(want - held) <= 0.01 * held, (want, held)


# ---- the serving process ------------------------------------------------------------------------------------

def _memory(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        text = f.read()
    return {k: int(re.search(k + r":\s+(\d+)", text).group(1)) * 1024 for k in ("VmHWM", "VmRSS")}


def serve_memory(model_dir: str, *flags: str, timeout: float = 1200) -> dict:
    """Start `deltaserve serve` on model_dir, wait until /health answers, send one completion; the server's VmHWM
    and VmRSS after load and after the request, its start-up screen, and whether the file is still mapped."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve", "serve", "--model", model_dir, "--port", str(port),
                             "--log-level", "warning", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() - t0 < timeout, "the server did not come up"
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        loaded = _memory(proc.pid)
        body = json.dumps({"model": model_dir, "prompt": "Hello there, how are you", "max_tokens": 8}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(req, timeout=600).read())["usage"]["completion_tokens"] > 0
        after = _memory(proc.pid)
        with open(f"/proc/{proc.pid}/maps") as f:
            mapped = [line for line in f if ".safetensors" in line]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    return {"loaded": loaded, "after": after, "mapped": mapped, "screen": out}


def _check_serve(model_dir: str, quantize: str = "none") -> None:
    """quantize: --quantize and --quantize-head (int4 at load: the bound and the plan at the run format's bytes)."""
    flags = ("--quantize", quantize, "--quantize-head", quantize) if quantize != "none" else ()
    r = serve_memory(model_dir, "--kv-cache-memory", "1G", *flags)
    serve = plan(model_dir, budget_bytes=POOL, quantization=None if quantize == "none" else quantize,
                 quantize_head=quantize)["serve"]
    bound = 1.10 * (serve["weight_bytes"] + POOL) + 0.8 * GB
    figures = (f"{model_dir}: weights as run {serve['weight_bytes'] / GB:.2f} GB, bound {bound / GB:.2f} GB, "
               f"after load {r['loaded']}, after a request {r['after']}, planner {serve['resident_bytes']}")
    print(figures)  # docs/planner.md's table (pytest -s)
    assert not r["mapped"], r["mapped"]
    for key in ("VmHWM", "VmRSS"):
        assert r["after"][key] <= bound, figures
    assert abs(serve["resident_bytes"] - r["after"]["VmRSS"]) <= 0.10 * r["after"]["VmRSS"], figures
    assert "memory:" in r["screen"], r["screen"][-2000:]


@pytest.fixture(scope="module")
def shape_08b() -> str:
    from deltaserve.embedded.model import ensure_model

    return ensure_model("qwen3.5-0.8b-shape")


@pytest.mark.skipif(not LINUX, reason="reads /proc/PID/status")
@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_serve_memory_08b_shape(shape_08b, quantize):
    """bf16 as stored, and int4 at load with the head (and so the tied embedding) in int4."""
    _check_serve(shape_08b, quantize)


@pytest.mark.slow
@pytest.mark.skipif(not LINUX or os.environ.get("DELTASERVE_SLOW") != "1", reason="DELTASERVE_SLOW=1: 4B shape")
@pytest.mark.parametrize("checkpoint,at_load", [(None, "none"), ("fp8", "none"), (None, "int4")],
                         ids=["bf16", "fp8", "int4-at-load"])
def test_serve_memory_4b_shape(checkpoint, at_load):
    from deltaserve.embedded.model import ensure_model

    _check_serve(ensure_model("qwen3.5-4b-shape", quantize=checkpoint), at_load)


def test_a_machine_too_small_is_refused_with_the_figures_before_loading(tiny_dir, monkeypatch):
    """The engine adds the weights as run, the runtime and --kv-cache-memory before reading a byte: more than the
    machine has available is a ConfigError that names each figure, not a trip to the OOM killer."""
    from deltaserve import LLM
    from deltaserve.config import ConfigError
    from deltaserve.runner import platform

    monkeypatch.setattr(platform, "available_bytes", lambda device: 15 * 10**8)
    with pytest.raises(ConfigError, match=r"does not fit: weights as run 0\.\d\d GB \+ loading's largest tensor "
                                          r"0\.00 GB \+ runtime 0\.75 GB \+ --kv-cache-memory 1\.07 GB = 1\.\d\d GB, "
                                          r"and this machine has 1\.50 GB"):
        LLM(model=tiny_dir, kv_cache_memory=1 << 30)
    LLM(model=tiny_dir, kv_cache_memory=64 << 20)  # fits


def test_loading_is_counted_at_its_largest_tensor(tiny_dir):
    """The pre-load checks count what loading holds beside the placed weights: the checkpoint's largest tensor read
    (the vision encoder's only with images on, a tied head's lm_head.weight never)."""
    import glob

    from safetensors import safe_open

    from deltaserve.config import ModelConfig
    from deltaserve.memory.resident import largest_tensor

    m = ModelConfig.from_path(tiny_dir)
    sizes = {}
    for path in glob.glob(os.path.join(tiny_dir, "*.safetensors")):
        with safe_open(path, "pt") as f:
            sizes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    nbytes = {k: 2 * math.prod(shape) for k, shape in sizes.items()}  # bf16
    text = max(v for k, v in nbytes.items() if not k.startswith(("model.visual.", "mtp.")))
    assert largest_tensor(tiny_dir, m, images=False) == text > 0
    assert largest_tensor(tiny_dir, m, images=True) == max(v for k, v in nbytes.items() if not k.startswith("mtp."))
    # a tied head quantized at load is streamed from the file a band at a time: the embedding no longer counts
    streamed = max(v for k, v in nbytes.items()
                   if not k.startswith(("model.visual.", "mtp.")) and not k.endswith("embed_tokens.weight"))
    assert m.tie_word_embeddings and largest_tensor(tiny_dir, m, images=False, quantize_head="int4") == streamed < text


def test_max_model_len_sizes_the_default_pool(tiny_dir, monkeypatch):
    """--max-model-len without --kv-cache-memory: a default pool that cannot hold one request of that length grows
    to the pool it needs (scheduler/build.py context_budget: exactly, the runs layout holding that many tokens and
    not one page more), where that fits in 90% of the memory available after loading; else a ConfigError naming the
    figures. A default that holds it stays."""
    from deltaserve import LLM
    from deltaserve.config import ConfigError, EngineConfig, ModelConfig
    from deltaserve.runner import platform
    from deltaserve.scheduler.build import build, context_budget

    mc = ModelConfig.from_path(tiny_dir)
    for layout in ("runs", "in-page"):
        cfg = EngineConfig(model=tiny_dir, max_model_len=50_000, max_num_seqs=4, cache_layout=layout)
        need = context_budget(mc, cfg, 50_000, "bfloat16")
        shape, memory, _ = build(mc, cfg, need, "bfloat16")
        assert memory.max_request_tokens() >= 50_000 and shape.max_model_len == 50_000
        with pytest.raises(ConfigError, match="exceeds what one request can hold"):
            build(mc, cfg, need - shape.pool.group_size * shape.pool.page_bytes - shape.pool.per_page_state_bytes,
                  "bfloat16")  # a page less
        if layout == "runs":
            assert memory.max_request_tokens() == 50_048  # whole 64-token pages
    monkeypatch.setattr(platform, "default_kv_budget", lambda *a: 8 << 20)  # a default that holds ~1.5k tokens
    llm = LLM(model=tiny_dir, max_model_len=50_000, max_num_seqs=4)
    assert llm.engine.max_model_len == 50_000
    assert llm.engine.memory.max_request_tokens() >= 50_000
    llm = LLM(model=tiny_dir, max_model_len=1_000, max_num_seqs=4)  # the default holds it: unchanged
    assert llm.engine.pool.num_pages == build(ModelConfig.from_path(tiny_dir), llm.engine.config, 8 << 20,
                                              "bfloat16")[0].pool.num_pages
    real = platform.available_bytes
    monkeypatch.setattr(platform, "available_bytes", lambda device: 15 * 10**8)  # passes the pre-load check
    with pytest.raises(ConfigError, match=r"--max-model-len 4,000,000 needs a KV pool of \d+\.\d\d GB and this "
                                          r"machine has 1\.50 GB available after loading the weights"):
        LLM(model=tiny_dir, max_model_len=4_000_000, max_num_seqs=4)
    monkeypatch.setattr(platform, "available_bytes", real)
