#!/usr/bin/env python3
"""Structure report of a trtmoe tree: module import cycles (function-level imports included), how many
trtmoe imports sit inside functions, the 10 longest functions and the line count.

    python scripts/structure_report.py .            # this tree
    python scripts/structure_report.py /path/to/an/older/worktree
"""
import ast, pathlib, sys, collections
root = pathlib.Path(sys.argv[1]) / "trtmoe"
mods = {}
for p in root.rglob("*.py"):
    parts = p.relative_to(root.parent).with_suffix("").parts
    mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
g = collections.defaultdict(set); fl = 0; longest = []
for m, p in mods.items():
    tree = ast.parse(p.read_text()); is_pkg = p.name == "__init__.py"
    infn = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            longest.append((f.end_lineno - f.lineno + 1, f"{m}.{f.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = m.split(".") if is_pkg else m.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                t = ".".join(base + ([node.module] if node.module else []))
                ts = [t] if node.module else [f"{t}.{a.name}" for a in node.names]
            else:
                ts = [node.module or ""]
        elif isinstance(node, ast.Import):
            ts = [a.name for a in node.names]
        else:
            continue
        for t in ts:
            if not t.startswith("trtmoe"): continue
            while t not in mods and "." in t: t = t.rsplit(".", 1)[0]
            if t in mods and t != m:
                g[m].add(t)
                if id(node) in infn: fl += 1
# Tarjan
idx = {}; low = {}; st = []; on = set(); sccs = []; c = [0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in g[v]:
        if w not in idx: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: sccs.append(sorted(comp))
for v in list(mods): 
    if v not in idx: sc(v)
print("modules", len(mods), "function-level trtmoe imports", fl)
print("import cycles (SCCs > 1 module):", len(sccs))
for s in sccs: print("  ", s)
print("10 longest functions:")
for n, name in sorted(longest, reverse=True)[:10]: print(f"   {n:4d} {name}")
print("lines in trtmoe/:", sum(len(p.read_text().splitlines()) for p in mods.values()))
