#!/usr/bin/env python3
"""Structure report of a trtmoe tree: module import cycles (function-level imports included), package
cycle groups (modules collapsed to their package), how many trtmoe imports sit inside functions, the
10 longest functions, the 10 largest classes (lines and methods), the 10 longest parameter lists,
the line count, and the files a reader opens to follow one routed-expert tensor from the HF source
to the engine's kernel; with ``--mentions``, the package files whose code (comments and docstrings
aside) mentions any of the given words (e.g. the files an architecture's names appear in); with
``--replay A..B``, the package files and lines a commit range of the tree's repository touches (e.g.
the commit that adds back an architecture a previous commit removed).

The imports are read by the same code that ``tests/test_imports.py`` enforces the layers with.

    python scripts/structure_report.py .            # this tree
    python scripts/structure_report.py /path/to/an/older/worktree
    python scripts/structure_report.py . --mentions phimoe phi3 sparse_mixer longrope
    python scripts/structure_report.py . --replay phi-replay~1..phi-replay

Following one expert tensor: each step names the functions that handle the tensor there (found by
qualified name anywhere in the package, so a function that moves is still found); a step's files are
the modules defining those functions and the trtmoe modules of every name their bodies use (through
the module's imports). Calls through an object (``fmt.quantize(...)``) are not resolved statically:
the step lists the function that implements them itself where it matters.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import subprocess
import sys
import tokenize
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent / "tests" / "test_imports.py"


def _import_reader():
    spec = importlib.util.spec_from_file_location("trtmoe_import_rules", _TESTS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def package_of(module: str) -> str:
    """``trtmoe.quant.awq`` -> ``trtmoe.quant``; top-level modules (``trtmoe.cli``) are their own node."""
    parts = module.split(".")
    return ".".join(parts[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for m, targets in graph.items():
        out[package_of(m)].update(package_of(t) for t in targets if package_of(t) != package_of(m))
    return out


def code_text(source: str) -> str:
    """``source`` without its comments and docstrings (string statements), lower-cased."""
    out, prev = [], None
    for t in tokenize.generate_tokens(io.StringIO(source).readline):
        if t.type == tokenize.COMMENT:
            continue
        if t.type == tokenize.STRING and (prev is None or prev.type in (tokenize.NEWLINE, tokenize.NL,
                                                                         tokenize.INDENT, tokenize.DEDENT)):
            prev = t
            continue
        out.append(t.string)
        prev = t
    return " ".join(out).lower()


# Following one routed-expert tensor: (step, functions that handle it there, as Class.method or function).
EXPERT_PATH = (
    ("checkpoint reading", ("HFCheckpoint.role", "RankLayout.expert_matrix")),
    ("plan", ("QuantPlan.slot_matrix_format", "RankLayout._experts", "RankLayout._per_expert")),
    ("format", ("RankLayout._quantized", "GroupInt4Format.quantize", "RankLayout._stacked_packed")),
    ("writer", ("write_rank",)),
    ("engine kernel", ("load_expert_bank", "PackedExperts._shard_forward", "kernel_for")),
)


def _definitions(mods: dict[str, Path]) -> dict[str, list[tuple[str, ast.AST]]]:
    """qualified name (``Class.method`` or ``function``) -> [(module, node)] over the package."""
    out: dict[str, list[tuple[str, ast.AST]]] = {}
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(node.name, []).append((m, node))
            elif isinstance(node, ast.ClassDef):
                for b in node.body:
                    if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        out.setdefault(f"{node.name}.{b.name}", []).append((m, b))
    return out


def _bound_names(module: str, path: Path, mods: dict[str, Path]) -> dict[str, str]:
    """Names a module binds by importing from trtmoe -> the trtmoe module they come from (the module
    itself for ``from ..quant import awq``)."""
    is_pkg = path.name == "__init__.py"
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                full = f"{src}.{a.name}"
                out[a.asname or a.name] = full if full in mods else src
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("trtmoe"):
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "trtmoe"
    return {k: v for k, v in out.items() if v in mods}


# Modules every other one uses (the error hierarchy, the console): not counted as files to open.
_INFRASTRUCTURE = ("trtmoe.errors", "trtmoe.console")


def expert_path(mods: dict[str, Path], root: Path) -> list[tuple[str, list[str], list[str]]]:
    """(step, functions found, files) along EXPERT_PATH; ``root`` holds trtmoe/."""
    defs = _definitions(mods)
    bound = {m: _bound_names(m, p, mods) for m, p in mods.items()}
    rel = {m: str(p.relative_to(root)) for m, p in mods.items()}
    out = []
    for step, names in EXPERT_PATH:
        found, files = [], set()
        for name in names:
            for m, node in defs.get(name, []):
                found.append(f"{m}.{name}")
                files.add(m)
                used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                files.update(bound[m][u] for u in used if u in bound[m])
        out.append((step, found, sorted(rel[f] for f in files if f not in _INFRASTRUCTURE)))
    return out


def replay(tree: Path, commits: str) -> list[tuple[str, int, int]]:
    """(package file, lines added, lines removed) that ``git diff A..B`` touches under trtmoe/."""
    r = subprocess.run(["git", "-C", str(tree), "diff", "--numstat", commits, "--", "trtmoe"],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"git diff {commits}: {r.stderr.strip()}")
    rows = [line.split("\t") for line in r.stdout.splitlines() if line.strip()]
    return [(path, int(a), int(d)) for a, d, path in rows]


def _n_params(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = f.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len([n for n in names if n not in ("self", "cls")]) + (a.vararg is not None) + (a.kwarg is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree", type=Path, help="a checkout holding trtmoe/")
    ap.add_argument("--mentions", nargs="+", metavar="WORD",
                    help="also list the package files whose code (comments and docstrings aside) mentions any "
                         "WORD (case-insensitive), with the number of mentions")
    ap.add_argument("--replay", metavar="A..B",
                    help="also count the package files and lines that this commit range of the tree's git "
                         "repository touches (e.g. a branch that re-adds an architecture)")
    args = ap.parse_args()
    rules = _import_reader()
    pkg = args.tree.resolve() / "trtmoe"
    mods = {}
    for p in sorted(pkg.rglob("*.py")):
        parts = p.relative_to(pkg.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph: dict[str, set[str]] = {m: set() for m in mods}
    in_functions, longest, classes, params = 0, [], [], []
    for m, p in mods.items():
        for f in ast.walk(ast.parse(p.read_text())):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                longest.append((f.end_lineno - f.lineno + 1, f"{m}.{f.name}"))
                params.append((_n_params(f), f"{m}.{f.name}"))
            elif isinstance(f, ast.ClassDef):
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in f.body)
                classes.append((f.end_lineno - f.lineno + 1, methods, f"{m}.{f.name}"))
        for target, _, in_fn in rules.imports(m, p):
            while target not in mods and "." in target:  # "from pkg import name" names an attribute
                target = target.rsplit(".", 1)[0]
            if target in mods and target != m:
                graph[m].add(target)
                in_functions += in_fn
    found = cycles(graph)
    print(f"modules {len(mods)}, trtmoe imports inside functions {in_functions}")
    print(f"import cycles (components of more than one module): {len(found)}")
    for comp in found:
        print("  ", comp)
    groups = cycles(package_graph(graph))
    print(f"package cycle groups (packages that import each other, directly or not): {len(groups)}")
    for comp in groups:
        print("  ", comp)
    print("10 longest functions (lines):")
    for n, name in sorted(longest, reverse=True)[:10]:
        print(f"  {n:4d} {name}")
    print("10 largest classes (lines, methods):")
    for n, k, name in sorted(classes, reverse=True)[:10]:
        print(f"  {n:4d} {k:3d} {name}")
    print("10 longest parameter lists (parameters, self/cls not counted):")
    for n, name in sorted(params, reverse=True)[:10]:
        print(f"  {n:4d} {name}")
    print("lines in trtmoe/:", sum(len(p.read_text().splitlines()) for p in mods.values()))
    path = expert_path(mods, pkg.parent)
    every = sorted({f for _, _, files in path for f in files})
    print(f"files a reader opens to follow one routed-expert tensor (HF source -> engine kernel): {len(every)}")
    for step, found, files in path:
        print(f"  {step}: {', '.join(found) or 'no function found'}")
        print(f"    {len(files)} files: {', '.join(files)}")
    if args.mentions:
        words = [w.lower() for w in args.mentions]
        hits = []
        for p in mods.values():
            code = code_text(p.read_text())
            n = sum(code.count(w) for w in words)
            if n:
                hits.append((str(p.relative_to(pkg.parent)), n))
        print(f"package files whose code mentions {' / '.join(args.mentions)}: {len(hits)}")
        for h, n in hits:
            print(f"  {n:4d} {h}")
    if args.replay:
        rows = replay(args.tree, args.replay)
        print(f"package files touched by {args.replay}: {len(rows)}, lines +{sum(r[1] for r in rows)} "
              f"-{sum(r[2] for r in rows)}")
        for f, a, d in rows:
            print(f"  +{a:<4d} -{d:<4d} {f}")


if __name__ == "__main__":
    sys.exit(main())
