#!/usr/bin/env python3
"""Structure report of a trtmoe tree: module import cycles (function-level imports included), package
cycle groups (modules collapsed to their package), how many trtmoe imports sit inside functions, the
10 longest functions, the 10 largest classes (lines and methods), the 10 longest parameter lists and
the line count; with ``--mentions``, the package files whose code (comments and docstrings aside)
mentions any of the given words (e.g. the files an architecture's names appear in).

The imports are read by the same code that ``tests/test_imports.py`` enforces the layers with.

    python scripts/structure_report.py .            # this tree
    python scripts/structure_report.py /path/to/an/older/worktree
    python scripts/structure_report.py . --mentions phimoe phi3 sparse_mixer longrope
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
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


if __name__ == "__main__":
    sys.exit(main())
