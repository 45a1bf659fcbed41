"""A model by its Hugging Face Hub id: resolved through a Hub cache the tests lay out themselves
(models--ORG--NAME/snapshots/<sha>, refs/main), offline (HF_HUB_OFFLINE=1), never the network."""
import os
import shutil

import httpx
import pytest

from deltaserve.config import ConfigError
from deltaserve.embedded.model import make_model
from deltaserve.hub import resolve_model

from server_support import RealServer

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model("tiny", str(tmp_path_factory.mktemp("made") / "tiny"))


def lay_out_hub(hf_home, repo_id: str, model_dir: str, sha: str = SHA, skip=()) -> str:
    """Copy model_dir into a Hub cache under hf_home as huggingface_hub writes one; returns the snapshot."""
    repo = os.path.join(str(hf_home), "hub", "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", sha)
    os.makedirs(snap)
    for name in os.listdir(model_dir):
        if name not in skip and os.path.isfile(os.path.join(model_dir, name)):
            shutil.copyfile(os.path.join(model_dir, name), os.path.join(snap, name))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(sha)
    return snap


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def test_hub_id_resolves_to_its_cached_snapshot(offline_hub, tiny_dir):
    snap = lay_out_hub(offline_hub, "test-org/tiny-a", tiny_dir)
    assert resolve_model("test-org/tiny-a") == snap
    assert resolve_model("test-org/tiny-a", revision=SHA) == snap  # a commit names the snapshot itself
    assert resolve_model(tiny_dir) == tiny_dir  # a directory is used as it is
    assert resolve_model(None) is None  # the embedded model


def test_missing_model_is_one_line_naming_it_and_how_to_get_it(offline_hub):
    with pytest.raises(ConfigError) as e:
        resolve_model("test-org/not-cached")
    msg = str(e.value)
    assert "\n" not in msg
    assert "test-org/not-cached" in msg and str(offline_hub) in msg and "HF_HUB_OFFLINE" in msg
    assert "hf download test-org/not-cached" in msg
    with pytest.raises(ConfigError, match="no revision|not in the Hugging Face cache"):
        resolve_model("test-org/not-cached", revision="v2")


def test_snapshot_without_weights_names_what_it_lacks(offline_hub, tiny_dir):
    lay_out_hub(offline_hub, "test-org/tiny-noweights", tiny_dir, skip=("model.safetensors",))
    with pytest.raises(ConfigError, match=r"has no weights \(\*\.safetensors\)"):
        resolve_model("test-org/tiny-noweights")


def test_paths_that_do_not_exist_are_not_hub_ids(offline_hub, tmp_path):
    for bad in (str(tmp_path / "nope"), "./nope", "../x/y"):
        with pytest.raises(ConfigError, match="no such directory"):
            resolve_model(bad)
    with pytest.raises(ConfigError, match="--revision v1 names a Hub revision"):
        resolve_model(str(tmp_path), revision="v1")


def test_serve_with_a_missing_hub_model_exits_with_one_line(offline_hub, capsys):
    from deltaserve.server.cli import main

    assert main(["test-org/absent", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "test-org/absent" in err and "hf download" in err
    assert main(["test-org/a", "--model", "test-org/b"]) == 2
    assert "disagree" in capsys.readouterr().err


def test_serve_a_model_by_hub_id_offline(tmp_path, tiny_dir):
    """`deltaserve serve ORG/NAME` with only the Hub cache: the served name is the id, generation works."""
    hf = tmp_path / "hf"
    lay_out_hub(hf, "test-org/tiny-served", tiny_dir)
    srv = RealServer("test-org/tiny-served", env={"HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"})
    try:
        models = httpx.get(srv.base + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["test-org/tiny-served"]  # OpenAI's fields, and vLLM's root and length
        assert models[0]["object"] == "model" and models[0]["root"] == "test-org/tiny-served"
        assert models[0]["owned_by"] == "deltaserve" and models[0]["max_model_len"] > 0
        r = httpx.post(srv.base + "/v1/completions", json={"model": "test-org/tiny-served", "prompt": "hello",
                                                            "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        screen = srv.log()  # the start-up screen names the model, its source and how to point a client at it
        assert "deltaserve is ready: test-org/tiny-served on " + srv.base in screen
        assert "from Hugging Face Hub, revision main" in screen
        claude = f"ANTHROPIC_BASE_URL={srv.base} ANTHROPIC_API_KEY=x ANTHROPIC_MODEL=test-org/tiny-served claude"
        assert claude in screen
    finally:
        srv.stop()
