"""`deltaserve doctor`: the machine's kernels, the models that fit a memory size, the agent CLIs; no model loaded."""
import json
import os
import stat

from deltaserve.model.ops.cpu_kernels import executable_isas
from deltaserve.tools import doctor


def _rows(capsys, memory: str, *extra: str) -> dict:
    assert doctor.main(["--memory", memory, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_doctor_plans_each_shape_and_format_for_the_memory_given(capsys, tmp_path, monkeypatch):
    fake = tmp_path / "claude"  # an agent CLI on PATH is found
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    r = _rows(capsys, "4G")
    assert r["memory_planned"] == 4 << 30
    assert r["agents"]["Claude Code"] == str(fake)
    rows = {(m["model"], m["format"]): m for m in r["models"]}
    assert {f for _, f in rows} == {"bf16", "fp8"} and ("qwen3.5-27b", "bf16") in rows
    assert not rows[("qwen3.5-27b", "bf16")]["fits"] and not rows[("qwen3.5-27b", "fp8")]["fits"]
    tiny = rows[("tiny", "bf16")]
    assert tiny["fits"] and tiny["context"] == tiny["max_position_embeddings"]
    small = rows[("qwen3.5-0.8b-shape", "bf16")]  # 1.7 GB of weights: a context, but not the model's whole one
    assert small["fits"] and 0 < small["context"] < small["max_position_embeddings"]
    assert rows[("qwen3.5-0.8b-shape", "fp8")]["context"] > small["context"]  # fp8 weights leave more for the cache
    for m in r["models"]:
        assert m["fits"] == (m["context"] > 0) and m["cache_needed"] <= m["cache_budget"]
        assert m["fits"] <= (m["weight_bytes"] < doctor.FIT_FRACTION * (4 << 30))
    more = {(m["model"], m["format"]): m for m in _rows(capsys, "8G")["models"]}
    assert more[("qwen3.5-0.8b-shape", "bf16")]["context"] > small["context"]
    assert r["kernels"]["executable"] == list(executable_isas())


def test_doctor_text_report(capsys):
    assert doctor.main(["--memory", "4G"]) == 0
    text = capsys.readouterr().out
    assert "kernels: " in text and "does not fit" in text and "largest in bf16: qwen3.5-0.8b-shape" in text
    assert "agent CLIs" in text and "Codex CLI" in text


def test_doctor_build_compiles_every_executable_build_and_fails_with_the_compilers_message(capsys, monkeypatch):
    from deltaserve.model.ops import cpu_kernels, fp8

    built = []
    monkeypatch.setattr(cpu_kernels, "executable_isas", lambda flags=None: ("amx", "avx512bf16", "avx2"))
    monkeypatch.setattr(cpu_kernels, "load_extension", lambda isa=None: built.append(isa))
    monkeypatch.setattr(fp8, "executable_builds", lambda: ("avx2", "generic"))
    monkeypatch.setattr(fp8, "load_fp8_extension", lambda build=None: built.append(f"fp8 {build}"))
    assert doctor.main(["--build"]) == 0
    assert built == ["avx512bf16", "avx2", "fp8 avx2", "fp8 generic"]  # amx is a view of the avx512bf16 build
    assert capsys.readouterr().out.count(": ready") == 4

    def broken(build=None):
        raise RuntimeError("error building extension: linear_fp8.cpp:12: error: expected ';'")

    monkeypatch.setattr(fp8, "load_fp8_extension", broken)
    assert doctor.main(["--build"]) == 1
    err = capsys.readouterr().err
    assert "fp8/int4 linear avx2: FAILED" in err and "linear_fp8.cpp:12: error: expected ';'" in err
