"""One call that evaluates quantized checkpoints against their reference on held-out text and writes
the report directory (what ``trtmoe report`` runs; the command only parses and prints)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint.atomic import check_output_spares_inputs
from ..errors import InputError
from ..quant.calibrate import load_calib
from ..runtime.load import load_tokenizer
from .html import build_report, render
from .quality import Reference, heldout_ids


@dataclass
class ReportResult:
    report: dict
    paths: dict[str, Path]
    evaluations: list[dict]
    heldout: dict | None
    warnings: list[str] = field(default_factory=list)


def _check_inputs(ref, quants, calib, data, bench_paths, out, tokenizer, samples, seq_len, batch_size, device):
    if not quants and not bench_paths:
        raise InputError("nothing to report", hint="pass --quant CKPT (repeatable) and/or --bench bench.json")
    if samples < 1 or seq_len < 2 or batch_size < 1:
        raise InputError("--samples and --batch-size must be ≥ 1 and --seq-len ≥ 2")
    ins = [p for p in (ref, *quants, calib, data, *bench_paths, tokenizer) if p is not None]
    check_output_spares_inputs(out, ins, what="report directory", outside=[p for p in ins if Path(p).is_dir()])
    for q in (ref, *quants) if quants else ():
        if not (Path(q) / "config.json").is_file():
            raise InputError("no config.json here; not a checkpoint", where=str(q),
                             hint="pass a `trtmoe convert` checkpoint or a `trtmoe build --backend embedded` "
                                  "engine dir")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is visible here", hint="use --device cpu")


def _read_benches(bench_paths) -> dict | None:
    benches = []
    for b in bench_paths:
        try:
            benches.append(json.loads(Path(b).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"cannot read benchmark JSON: {e}", where=str(b)) from None
    if not benches:
        return None
    return {"rows": [r for b in benches for r in b.get("rows", [])],
            "targets": [t for b in benches for t in b.get("targets", [])]}


def write_report(ref: str | Path, out: str | Path, *, quants=(), calib=None, data=None, bench_paths=(),
                 samples: int = 64, seq_len: int = 128, batch_size: int = 8, tokenizer=None, text_field="text",
                 device: str = "cpu", on_evaluate: Callable[[Path], None] | None = None) -> ReportResult:
    """Evaluate ``quants`` against ``ref`` on ``samples`` held-out windows (``data``, or the corpus's
    heldout split), add the calibration's heatmaps and any benchmark curves, and write report.json and
    report.html under ``out``. Warnings name what makes the figures less than held-out or complete."""
    _check_inputs(ref, quants, calib, data, bench_paths, out, tokenizer, samples, seq_len, batch_size, device)
    warnings: list[str] = []
    cal = load_calib(calib) if calib else None
    if cal and data is not None and cal.get("data", {}).get("path") and \
            Path(cal["data"]["path"]).resolve() == Path(data).resolve():
        warnings.append(f"the held-out data {data} is the calibration data: these statistics are not held-out")
    ids = None
    if quants:
        tok = load_tokenizer(tokenizer or ref)
        ids = heldout_ids(tok, samples=samples, seq_len=seq_len, path=data, text_field=text_field)
        if ids.shape[0] < samples:
            warnings.append(f"the held-out text yields only {ids.shape[0]} windows of {seq_len} tokens "
                            f"(asked for {samples})")
    bench = _read_benches(bench_paths)
    evals = []
    refp = Reference(ref, ids, batch_size=batch_size, device=device) if quants else None
    for q in quants:
        if on_evaluate:
            on_evaluate(Path(q))
        evals.append(refp.compare(q))
    if cal and cal["routing"]["under_observed"]:
        uo = cal["routing"]["under_observed"]
        warnings.append(f"{len(uo)} expert(s) saw fewer than {cal['routing']['min_tokens_threshold']} calibration "
                        "tokens, so their ΔKL is partly estimated (layer/expert: tokens): "
                        + ", ".join(f"{u['layer']}/{u['expert']}: {u['tokens']}" for u in uo))
    heldout = None if ids is None else {
        "source": str(data) if data is not None else "corpus split 'heldout'", "samples": int(ids.shape[0]),
        "seq_len": int(ids.shape[1]), "tokens_scored": int(ids.shape[0] * (ids.shape[1] - 1)),
        "sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest()}
    reference = {"checkpoint": str(ref), "footprint": refp.footprint, "seconds": refp.seconds} if refp else None
    rep = build_report(calib=cal, reference=reference, evaluations=evals, bench=bench, heldout=heldout,
                       warnings=warnings)
    return ReportResult(rep, render(rep, out), evals, heldout, warnings)
