#!/usr/bin/env python3
"""Structure report of a trtmoe tree: module import cycles (function-level imports included), how many
trtmoe imports sit inside functions, the 10 longest functions and the line count.

The imports are read by the same code that ``tests/test_imports.py`` enforces the layers with.

    python scripts/structure_report.py .            # this tree
    python scripts/structure_report.py /path/to/an/older/worktree
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree", type=Path, help="a checkout holding trtmoe/")
    args = ap.parse_args()
    rules = _import_reader()
    pkg = args.tree.resolve() / "trtmoe"
    mods = {}
    for p in sorted(pkg.rglob("*.py")):
        parts = p.relative_to(pkg.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph: dict[str, set[str]] = {m: set() for m in mods}
    in_functions, longest = 0, []
    for m, p in mods.items():
        for f in ast.walk(ast.parse(p.read_text())):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                longest.append((f.end_lineno - f.lineno + 1, f"{m}.{f.name}"))
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
    print("10 longest functions:")
    for n, name in sorted(longest, reverse=True)[:10]:
        print(f"  {n:4d} {name}")
    print("lines in trtmoe/:", sum(len(p.read_text().splitlines()) for p in mods.values()))


if __name__ == "__main__":
    sys.exit(main())
