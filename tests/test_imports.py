"""The package's import graph is layered: a module imports only from its own layer or below, so there
are no import cycles between layers, and library modules import what they use at the top.

Layers, lowest first (a module's layer is its longest matching pattern):

0. ``trtmoe``, ``errors``, ``console``, ``quant`` (the package itself: format names, no torch)
1. ``model``, ``data``, ``config``, ``matmul`` (which CPU library multiplies: engine and quantization
   searches)
2. ``hf``, ``parallel``
3. quantization numerics: ``quant.formats``, ``quant.plan``, ``quant.allocate``, ``quant.awq``, ``quant.fp_gptq``,
   ``quant.gptq``, ``quant.calib_schema``
4. ``checkpoint`` (layout, writer, manifest, support table, verify)
5. ``runtime`` (the embedded engine)
6. ``targets`` (deployment targets: support cells, plan rules, writer and build facts per target)
7. calibration and policies: ``quant.calibrate``, ``quant.sensitivity``, ``quant.policies``,
   ``quant.planning``
8. stages: ``build``, ``report``, ``triton``, and the command modules (``*.commands``)
9. ``cli``

Imports inside functions are allowed in the command layer (``cli`` and ``*.commands``: ``trtmoe
--help`` must not import torch) and for third-party modules; a library module's imports of trtmoe
modules sit at its top, where the layer rule sees them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "trtmoe"

LAYERS = [
    ["trtmoe", "trtmoe.errors", "trtmoe.console", "trtmoe.quant"],
    ["trtmoe.model.*", "trtmoe.data", "trtmoe.config", "trtmoe.matmul"],
    ["trtmoe.hf.*", "trtmoe.parallel.*"],
    ["trtmoe.quant.formats", "trtmoe.quant.plan", "trtmoe.quant.allocate", "trtmoe.quant.awq",
     "trtmoe.quant.gptq", "trtmoe.quant.fp_gptq", "trtmoe.quant.calib_schema"],
    ["trtmoe.checkpoint.*"],
    ["trtmoe.runtime.*"],
    ["trtmoe.targets.*"],
    ["trtmoe.quant.calibrate", "trtmoe.quant.sensitivity", "trtmoe.quant.policies", "trtmoe.quant.planning",
     "trtmoe.quant.stream"],
    ["trtmoe.build.*", "trtmoe.report.*", "trtmoe.triton.*", "trtmoe.quant.commands"],
    ["trtmoe.cli"],
]


def layer_of(module: str) -> int | None:
    best = None
    for i, patterns in enumerate(LAYERS):
        for p in patterns:
            hit = (module == p[:-2] or module.startswith(p[:-1])) if p.endswith(".*") else module == p
            if hit and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports(name: str, path: Path):
    """(imported trtmoe module, line, inside a function) for every import statement of a module."""
    tree = ast.parse(path.read_text())
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                targets = [node.module or ""]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t == "trtmoe" or t.startswith("trtmoe."):
                # "from trtmoe import X" names a package attribute or a submodule.
                yield t, node.lineno, id(node) in in_function


def _command_layer(name: str) -> bool:
    return name == "trtmoe.cli" or name.endswith(".commands")


ALL = modules()


def test_every_module_has_a_layer():
    assert not [m for m in ALL if layer_of(m) is None]


@pytest.mark.parametrize("name", sorted(ALL))
def test_imports_respect_the_layers(name):
    mine = layer_of(name)
    up = []
    for target, line, _ in imports(name, ALL[name]):
        mod = target if target in ALL or layer_of(target) is not None else target.rsplit(".", 1)[0]
        lt = layer_of(mod)
        if lt is not None and lt > mine:
            up.append(f"line {line}: {target} (layer {lt} > {mine})")
    assert not up, f"{name} imports from a higher layer: " + "; ".join(up)


@pytest.mark.parametrize("name", sorted(m for m in ALL if not _command_layer(m)))
def test_library_modules_import_trtmoe_at_the_top(name):
    inner = [f"line {line}: {t}" for t, line, in_fn in imports(name, ALL[name]) if in_fn]
    assert not inner, f"{name} imports trtmoe modules inside functions: " + "; ".join(inner)


def test_the_rules_catch_what_they_forbid(tmp_path):
    bad = tmp_path / "trtmoe" / "hf"
    bad.mkdir(parents=True)
    (bad / "x.py").write_text("from ..runtime.engine import EmbeddedEngine\n\ndef f():\n    from ..errors import E\n")
    found = list(imports("trtmoe.hf.x", bad / "x.py"))
    assert found == [("trtmoe.runtime.engine", 1, False), ("trtmoe.errors", 4, True)]
    assert layer_of("trtmoe.runtime.engine") > layer_of("trtmoe.hf.x")


def test_serving_launcher_imports_no_torch():
    """``trtmoe serve`` starts tritonserver without importing torch (about 1.5 s of start-up the
    server's own processes then spend again): the launcher and the repository manifest reader stay
    torch-free."""
    import subprocess
    import sys

    code = ("import sys\nimport trtmoe.cli, trtmoe.triton.serve, trtmoe.checkpoint.manifest\n"
            "print('torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
