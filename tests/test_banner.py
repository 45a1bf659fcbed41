"""The start-up screen of `deltaserve serve` and the kernel-build notice (the served screen itself: test_hub.py)."""
import json
import logging
import os
import shlex
from types import SimpleNamespace

import pytest

from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.model.ops import build_notice
from deltaserve.server.banner import client_base, client_lines, startup_screen


def test_client_base_answers_on_loopback_for_a_wildcard_bind():
    assert client_base("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert client_base("10.1.2.3", 9) == "http://10.1.2.3:9"
    assert client_base("::1", 8000) == "http://[::1]:8000"


def test_client_lines_are_shell_lines_with_the_base_and_model():
    lines = dict(client_lines("http://h:1", "org/m"))
    assert set(lines) == {"Claude Code", "Codex CLI", "Qwen Code", "opencode", "OpenAI SDK", "Anthropic SDK"}
    for client in ("Claude Code", "Codex CLI", "Qwen Code", "opencode"):
        shlex.split(lines[client])  # quoting holds
    env = dict(w.split("=", 1) for w in shlex.split(lines["Claude Code"]) if "=" in w)
    assert env == {"ANTHROPIC_BASE_URL": "http://h:1", "ANTHROPIC_API_KEY": "x", "ANTHROPIC_MODEL": "org/m"}
    conf = json.loads(shlex.split(lines["opencode"])[0].split("=", 1)[1])
    assert conf["model"] == "deltaserve/org/m"
    assert conf["provider"]["deltaserve"]["options"]["baseURL"] == "http://h:1/v1"
    assert 'base_url="http://h:1/v1",wire_api="responses"' in lines["Codex CLI"]


def _fake_engine(tmp_path, **cfg):
    mc = ModelConfig(model_type="qwen3_5_text", vocab_size=10, hidden_size=8, num_hidden_layers=4,
                     layer_types=("linear_attention",) * 3 + ("full_attention",), num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, partial_rotary_factor=1.0,
                     max_position_embeddings=4096, tie_word_embeddings=True, linear_conv_kernel_dim=4,
                     linear_key_head_dim=4, linear_value_head_dim=4, linear_num_key_heads=1, linear_num_value_heads=1)
    (tmp_path / "config.json").write_text("{}")
    pool = SimpleNamespace(num_pages=10, pool_tokens=640, num_slots=4, total_bytes=3 << 20)
    return SimpleNamespace(config=EngineConfig(model=str(tmp_path), **cfg), model_path=str(tmp_path),
                           model_name=str(tmp_path), model_config=mc, dtype="bfloat16",
                           device=SimpleNamespace(type="cpu"), cpu_kernels="torch", pool=pool, block_size=64,
                           max_model_len=512, memory=SimpleNamespace(max_request_tokens=lambda: 512))


def test_screen_says_what_was_chosen_and_hides_the_key(tmp_path):
    text = startup_screen(_fake_engine(tmp_path, max_model_len=512), "0.0.0.0", 8000, "mine", api_key="s3cret")
    assert text.startswith("deltaserve is ready: mine on http://127.0.0.1:8000")
    assert "s3cret" not in text and "ANTHROPIC_API_KEY=$KEY" in text
    assert "512 tokens per request (--max-model-len)" in text
    assert "torch ops" in text and "quantization: none" in text
    assert "layout runs, 10 pages of 64 tokens = 640 tokens + 4 GDN slots (3 MiB)" in text


def test_screen_says_what_the_process_holds(tmp_path):
    """The memory row: weights as run (the model's own count), the pool split into KV pages and GDN slots, and
    everything else the process holds beyond them, with its resident and peak figures."""
    eng = _fake_engine(tmp_path)
    eng.pool.slot_bytes = 250_000  # 4 slots: 1 MB of the pool's 3 MiB
    eng.model = SimpleNamespace(held_weight_bytes=lambda: {"text": 2 * 10**9, "head": 5 * 10**8, "vision": 0, "mtp": 0,
                                                         "total": 25 * 10**8})
    [row] = [line for line in startup_screen(eng, "127.0.0.1", 8000, "m").splitlines() if "memory:" in line]
    assert "weights 2.50 GB as run (head 500.0 MB)" in row
    assert "pool 3.1 MB (KV pages 2.1 MB, GDN slots 1.0 MB)" in row
    assert "everything else" in row and "resident" in row and "peak" in row


def test_a_build_is_announced_with_the_last_time_and_recorded(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DELTASERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    src = tmp_path / "k.cpp"
    src.write_text("")
    caplog.set_level(logging.INFO, logger="deltaserve")
    with build_notice.build_notice("fake_ext", [str(src)], "the fake kernels"):
        pass  # no library: a build
    assert "building the fake kernels" in caplog.text and "built the fake kernels" in caplog.text
    assert build_notice.last_build_seconds("the fake kernels") is not None
    caplog.clear()
    with build_notice.build_notice("fake_ext", [str(src)], "the fake kernels"):
        pass
    assert "last time" in caplog.text  # still no library: a build again, with the time recorded before
    lib = tmp_path / "ext" / "fake_ext" / "fake_ext.so"
    lib.write_text("")
    os.utime(src, (1, 1))  # the source is older than the library: a load, said nothing of
    caplog.clear()
    with build_notice.build_notice("fake_ext", [str(src)], "the fake kernels"):
        pass
    assert "build" not in caplog.text


def test_a_taken_port_ends_serve_before_the_model_loads(capsys, monkeypatch):
    """The listening socket is bound before the load: a port in use is one line and status 2, and nothing was
    loaded (uvicorn alone would bind after the lifespan, with the screen already claiming the server ready)."""
    import socket

    from deltaserve.server import app as app_module
    from deltaserve.server.cli import listen_socket, main

    monkeypatch.setattr(app_module, "build_app", lambda *a, **k: pytest.fail("the app was built"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["--port", str(port), "--log-level", "warning"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"127.0.0.1:{port}" in err and "--port" in err, err
    with listen_socket("127.0.0.1", 0) as s:  # port 0: a free one, which the screen then shows
        assert s.getsockname()[1] > 0
