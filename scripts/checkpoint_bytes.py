#!/usr/bin/env python3
"""Checkpoint bytes of a trtmoe tree over a grid: seeded tiny models per architecture x 4 layouts x
(float, uniform int8, uniform int4, per-expert int8/int4 mix). Prints {file: sha256 prefix} as JSON
(manifest.json excepted), so two trees (e.g. a git worktree of an older commit) can be compared:

    python scripts/checkpoint_bytes.py . mixtral,qwen2_moe,deepseek_v1,qwen3_moe,phimoe > now.json
"""
import argparse, hashlib, json, sys, tempfile, importlib.util
from pathlib import Path
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("repo", help="source tree whose trtmoe converts")
ap.add_argument("archs", help="comma-separated architectures, e.g. mixtral,qwen2_moe,deepseek_v1,qwen3_moe,phimoe")
args = ap.parse_args()
repo = Path(args.repo); sys.path.insert(0, str(repo))
spec = importlib.util.spec_from_file_location("mtm", repo / "scripts/make_tiny_models.py"); mtm = importlib.util.module_from_spec(spec); spec.loader.exec_module(mtm)
from trtmoe.checkpoint.writer import convert
from trtmoe.hf.reader import HFCheckpoint
from trtmoe.quant.plan import QuantPlan

out = {}
tmp = Path(tempfile.mkdtemp())
archs = args.archs.split(",")
for arch in archs:
    src = mtm.make_tiny_model(arch, tmp / f"src-{arch}")
    with HFCheckpoint(src) as s: m = s.model
    layers = [l for l in range(m.num_layers) if m.moe_layers[l]]
    plans = {"float": None, "int8": QuantPlan({l: ["int8"] * m.num_experts for l in layers}, granularity="layer"),
             "int4": QuantPlan({l: ["int4"] * m.num_experts for l in layers}, granularity="layer"),
             "mixedexp": QuantPlan({l: (["int8", "int4"] * m.num_experts)[:m.num_experts] for l in layers}, granularity="expert")}
    for lay in [(1,1,None,None),(2,1,1,2),(2,1,2,1),(1,2,None,None)]:
        for pn, plan in plans.items():
            key = f"{arch}-tp{lay[0]}pp{lay[1]}mtp{lay[2]}ep{lay[3]}-{pn}"
            d = tmp / key
            kw = dict(tp=lay[0], pp=lay[1], moe_tp=lay[2], moe_ep=lay[3], dtype="float16", quant=plan)
            try:
                convert(src, d, **kw)
            except Exception as e:
                out[key] = f"ERR {type(e).__name__}"; continue
            for f in sorted(d.rglob("*")):
                if f.is_file() and f.name != "manifest.json":
                    out[f"{key}/{f.relative_to(d)}"] = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
json.dump(out, sys.stdout, indent=0, sort_keys=True)
