"""The package's layers: which may import which, and which never import torch.

Read statically (ast) over every module of deltaserve/, imports inside functions included: an import that a
function makes at call time is an arrow all the same. A layer imports only from layers below it and from
its own package; packages that share a layer do not import each other. The torch-free packages (what the
simulator and the planner run on) import no torch and nothing that does. Apart from the arrows, no two
modules import each other at module level, however long the circle.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "deltaserve")

# bottom first; a top-level package or root module of deltaserve per name
LAYERS = [
    ["errors"],
    ["config", "presets", "hub", "home", "safetensors_header"],
    ["memory", "model", "text", "media"],
    ["scheduler", "embedded"],
    ["runner", "sim"],
    ["parallel"],
    ["engine"],
    ["__init__"],  # the package's face: LLM, SamplingParams, LLMEngine, EngineConfig and __version__
    ["server", "profile"],
    ["bench"],
    ["tools"],  # planner, doctor (which lists the agent CLIs bench sets up), cluster
    ["cli"],
    ["__main__"],
]
# modules that must run without torch (the simulator's and the planner's world), each with what it imports
TORCH_FREE = ["errors", "config", "presets", "hub", "home", "safetensors_header", "memory", "scheduler", "sim",
              "engine.inputs", "engine.sampling_params", "engine.outputs", "profile.coverage", "profile.grid",
              "profile.machine", "tools.planner",
              "tools.validate.scenarios", "tools.validate.simulate", "tools.validate.speed", "tools.validate.compare",
              "tools.validate.report"]


def module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def read_imports(root: str) -> dict[str, list[tuple[str, bool, int]]]:
    """module -> [(imported module or name path, at module level?, line)] for every import of the package."""
    base = os.path.basename(root)
    found: dict[str, list[tuple[str, bool, int]]] = {}
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            mod = module_name(path, root)
            pkg = mod if f == "__init__.py" else mod.rsplit(".", 1)[0]
            out = found[mod] = []

            def visit(node, top):
                for child in ast.iter_child_nodes(node):
                    inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                    if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                        inner = False  # read by type checkers only: an arrow, but no circle at run time
                    if isinstance(child, ast.ImportFrom):
                        if child.level:
                            parts = pkg.split(".")
                            target = ".".join(parts[: len(parts) - child.level + 1] + [child.module or ""]).rstrip(".")
                        else:
                            target = child.module or ""
                        for a in child.names:
                            out.append((f"{target}.{a.name}", top, child.lineno))
                    elif isinstance(child, ast.Import):
                        out.extend((a.name, top, child.lineno) for a in child.names)
                    visit(child, inner)

            with open(path) as fh:
                visit(ast.parse(fh.read(), path), True)
            found[mod] = [(t, top, ln) for t, top, ln in out if t.split(".")[0] in (base, "torch")]
    return found


def resolve(target: str, modules: set[str]) -> str | None:
    """The module an import names: `pkg.mod.Name` -> `pkg.mod`; a module itself stays."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def top_package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(root: str, layers: list[list[str]]) -> list[str]:
    rank = {name: i for i, names in enumerate(layers) for name in names}
    imports = read_imports(root)
    modules = set(imports)
    bad = []
    for mod, targets in sorted(imports.items()):
        src = top_package(mod)
        assert src in rank, f"{mod}: package {src!r} is in no layer; add it to LAYERS"
        for target, _, line in targets:
            dst_mod = resolve(target, modules)
            if dst_mod is None:
                continue  # torch
            dst = top_package(dst_mod)
            if dst == src:
                continue
            if rank[dst] >= rank[src]:
                how = "sideways" if rank[dst] == rank[src] else "up"
                bad.append(f"{mod}:{line} imports {dst_mod} ({src} -> {dst} runs {how})")
    return bad


def module_cycles(root: str) -> list[list[str]]:
    """Circles among module-level imports (strongly connected components of more than one module)."""
    imports = read_imports(root)
    modules = set(imports)
    graph = defaultdict(set)
    for mod, targets in imports.items():
        for target, top, _ in targets:
            dst = resolve(target, modules)
            if top and dst and dst != mod and not mod.startswith(dst + "."):  # a package's own __init__ is no edge
                graph[mod].add(dst)
    index, low, stack, on, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(modules):
        if v not in index:
            connect(v)
    return out


def torch_importers(root: str, torch_free: list[str]) -> list[str]:
    """Torch-free modules that import torch, or a module of the package that is not torch-free."""
    base = os.path.basename(root)
    imports = read_imports(root)
    modules = set(imports)
    free = {m for m in modules for t in torch_free if m == f"{base}.{t}" or m.startswith(f"{base}.{t}.")}
    bad = []
    for mod in sorted(free):
        for target, _, line in imports[mod]:
            dst = resolve(target, modules)
            if target.split(".")[0] == "torch":
                bad.append(f"{mod}:{line} imports torch")
            elif dst is not None and dst not in free and not mod.startswith(dst + "."):
                bad.append(f"{mod}:{line} imports {dst}, which is not torch-free")
    return bad


# ---------------------------------------------------------------- the package


def test_every_import_runs_down_the_layers():
    assert layer_violations(PACKAGE, LAYERS) == []


def test_no_module_level_import_circle():
    assert module_cycles(PACKAGE) == []


def test_torch_free_layers_import_no_torch_statically():
    assert torch_importers(PACKAGE, TORCH_FREE) == []


def test_torch_free_layers_import_no_torch_when_run():
    mods = [f"deltaserve.{m}" for m in TORCH_FREE]
    walk = ("import importlib, pkgutil, sys\n"
            f"for name in {mods!r}:\n"
            "    m = importlib.import_module(name)\n"
            "    for info in pkgutil.walk_packages(getattr(m, '__path__', []), name + '.'):\n"
            "        if not info.name.endswith('__main__'):\n"
            "            importlib.import_module(info.name)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", walk], check=True, cwd=ROOT)


# ---------------------------------------------------------------- the checks themselves catch what they must


def _tree(tmp_path, files: dict[str, str]) -> str:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(root)


def test_an_import_up_or_sideways_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from ..high import b\n",  # inside a function: still an arrow
        "mid/__init__.py": "",
        "mid/c.py": "from pkg.side import d\n",
        "side/__init__.py": "",
        "side/d.py": "from ..low import a\n",
        "high/__init__.py": "",
        "high/b.py": "from ..low import a\n",
    })
    layers = [["low"], ["mid", "side"], ["high", "__init__"]]
    assert layer_violations(root, layers) == [
        "pkg.low.a:2 imports pkg.high.b (low -> high runs up)",
        "pkg.mid.c:1 imports pkg.side.d (mid -> side runs sideways)",
    ]


def test_a_module_level_circle_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import x\n",
        "b.py": "from . import c\nx = 1\n",
        "c.py": "import pkg.a\n",
        "d.py": "def f():\n    from .a import x\n",  # at call time only: no circle
        "e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .f import y\n",  # for type checkers
        "f.py": "from .e import z\n",
    })
    assert module_cycles(root) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_torch_reached_through_another_module_is_caught(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "free/__init__.py": "",
        "free/a.py": "from ..heavy import b\n",
        "heavy/__init__.py": "",
        "heavy/b.py": "import torch\n",
    })
    assert torch_importers(root, ["free"]) == ["pkg.free.a:1 imports pkg.heavy.b, which is not torch-free"]
    assert torch_importers(root, ["free", "heavy"]) == ["pkg.heavy.b:1 imports torch"]
