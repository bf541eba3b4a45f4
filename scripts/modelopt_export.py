#!/usr/bin/env python3
"""Export a Hugging Face MoE checkpoint with NVIDIA ModelOpt and describe what it wrote.

Runs in ModelOpt's own environment (``scripts/modelopt_env.sh`` makes it), never inside trtmoe:
trtmoe's conformance tests call it as a subprocess and compare the checkpoint ``trtmoe convert
--target trtllm-pytorch`` writes for the same model against this one.

    .venv-modelopt/bin/python scripts/modelopt_export.py MODEL_DIR OUT_DIR --format fp8 \\
        --calib-ids ids.json [--layer-format 0=fp8 --layer-format 1=nvfp4]
    .venv-modelopt/bin/python scripts/modelopt_export.py MODEL_DIR OUT_DIR --calib-ids ids.json \\
        --job fp8 fp8 --job nvfp4 nvfp4 --job graded bf16 0=fp8 1=nvfp4 2=bf16

``--format`` picks one of ModelOpt's preset configs for every quantized module; ``--layer-format L=F``
(repeatable) gives decoder layer L's routed experts their own preset instead, as ModelOpt's
AutoQuantize does when it settles a per-layer choice (its export writes MIXED_PRECISION then); a
layer not named keeps ``--format`` (``bf16``: left unquantized). Calibration runs the model on the
token ids in ``--calib-ids`` (a JSON list of lists). After the export, ``OUT_DIR/description.json``
lists every tensor (name, safetensors dtype, shape) and the quantization config files.

``--job NAME FORMAT [L=F ...]`` (repeatable, instead of ``--format``/``--layer-format``) makes several
exports in one process, which pays ModelOpt's import once: each job reloads the model from
MODEL_DIR, quantizes it with its own config and exports to ``OUT_DIR/NAME`` exactly as a separate
run with ``--format FORMAT --layer-format L=F ...`` would.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

PRESETS = {  # trtmoe format name -> ModelOpt preset config
    "fp8": "FP8_DEFAULT_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG",
    "int8": "INT8_WEIGHT_ONLY_CFG",
    "fp8_block_wo": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",
    "mxfp4": "MXFP4_DEFAULT_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
    "nvfp4_w4a16": "W4A16_NVFP4_CFG",
}


def describe(out: Path) -> dict:
    from safetensors import safe_open

    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                tensors[k] = {"dtype": sl.get_dtype(), "shape": list(sl.get_shape()), "file": f.name}
    desc = {"tensors": tensors}
    for name in ("hf_quant_config.json", "config.json", "model.safetensors.index.json"):
        p = out / name
        if p.is_file():
            desc[name] = json.loads(p.read_text())
    return desc


def layer_config(mtq, base_fmt: str, layer_formats: dict[int, str]) -> dict:
    """ModelOpt's quant config: ``base_fmt`` everywhere, each named layer's experts in its own preset."""
    if base_fmt == "bf16":
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        cfg = copy.deepcopy(getattr(mtq, PRESETS[base_fmt]))
    for layer, fmt in sorted(layer_formats.items()):
        pattern = f"*layers.{layer}.*experts*"
        if fmt == "bf16":
            cfg["quant_cfg"].append({"quantizer_name": f"{pattern}weight_quantizer", "enable": False})
            cfg["quant_cfg"].append({"quantizer_name": f"{pattern}input_quantizer", "enable": False})
            continue
        preset = getattr(mtq, PRESETS[fmt])
        for entry in preset["quant_cfg"]:
            name = entry.get("quantizer_name", "")
            if name in ("*weight_quantizer", "*input_quantizer") and "parent_class" not in entry:
                e = copy.deepcopy(entry)
                e["quantizer_name"] = pattern + name.lstrip("*")
                cfg["quant_cfg"].append(e)
        # A preset that leaves inputs unquantized must switch the base format's input quantizer off here.
        if not any(e.get("quantizer_name") == "*input_quantizer" and e.get("enable", True)
                   for e in preset["quant_cfg"]):
            cfg["quant_cfg"].append({"quantizer_name": f"{pattern}input_quantizer", "enable": False})
    return cfg


def parse_jobs(ap: argparse.ArgumentParser, args) -> list[tuple[Path, str, dict[int, str]]]:
    """(output directory, base format, per-layer formats) for every export asked for."""
    choices = {*PRESETS, "bf16"}

    def layers(specs: list[str]) -> dict[int, str]:
        out = {}
        for s in specs:
            layer, sep, fmt = s.partition("=")
            if not sep or not layer.isdigit() or fmt not in choices:
                ap.error(f"layer format {s!r}: expected L=FORMAT with FORMAT one of {sorted(choices)}")
            out[int(layer)] = fmt
        return out

    if not args.job:
        return [(Path(args.out), args.format, layers(args.layer_format))]
    if args.layer_format:
        ap.error("--layer-format goes inside --job NAME FORMAT [L=F ...] when --job is given")
    jobs, names = [], set()
    for name, *rest in args.job:
        if not rest or rest[0] not in choices:
            ap.error(f"--job {name}: expected NAME FORMAT [L=F ...] with FORMAT one of {sorted(choices)}")
        if name in names or "/" in name or name in (".", ".."):
            ap.error(f"--job {name}: job names must be distinct folder names")
        names.add(name)
        jobs.append((Path(args.out) / name, rest[0], layers(rest[1:])))
    return jobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--format", default="fp8", choices=[*PRESETS, "bf16"])
    ap.add_argument("--layer-format", action="append", default=[], help="L=FORMAT (repeatable)")
    ap.add_argument("--job", action="append", nargs="+", default=[], metavar="ARG",
                    help="NAME FORMAT [L=F ...]: one export into OUT/NAME, FORMAT everywhere, layer L's experts in F (repeatable)")
    ap.add_argument("--calib-ids", required=True, help="JSON list of token-id lists")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    jobs = parse_jobs(ap, args)

    import torch
    import modelopt.torch.opt  # noqa: F401  (import order: opt before quantization avoids a cycle)
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    import transformers
    from transformers import AutoModelForCausalLM

    # A multimodal Llama-4 (Llama4ForConditionalGeneration) loads as its own class: the causal-LM auto
    # class would build its text model alone, under other tensor names.
    arch = (json.loads((Path(args.model) / "config.json").read_text()).get("architectures") or [""])[0]
    model_class = getattr(transformers, arch) if arch == "Llama4ForConditionalGeneration" else AutoModelForCausalLM

    ids = json.loads(Path(args.calib_ids).read_text())

    def forward_loop(m):
        with torch.no_grad():
            for row in ids:
                m(input_ids=torch.tensor([row]))

    for out, base_fmt, layer_formats in jobs:
        t0 = time.monotonic()
        # A fresh model per job: quantization replaces its modules in place.
        model = model_class.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
        mtq.quantize(model, layer_config(mtq, base_fmt, layer_formats), forward_loop)
        with torch.inference_mode():
            export_hf_checkpoint(model, export_dir=str(out))
        (out / "description.json").write_text(json.dumps(describe(out), indent=1, sort_keys=True))
        del model
        print(f"{out.name}: exported in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 0

if __name__ == "__main__":
    sys.exit(main())
