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
from ..quant.calibrate import load_calib, load_cost
from ..runtime.checkpoint_reader import load_config
from ..runtime.load import checkpoint_dir_of, load_engine, load_tokenizer
from .html import build_report, render
from .moves import ExpertLayout, what_it_moves
from .quality import Reference, heldout_ids
from .whatif import measure_what_ifs

# Batch sizes the "what it moves" section plots.
MOVES_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class ReportResult:
    report: dict
    paths: dict[str, Path]
    evaluations: list[dict]
    heldout: dict | None
    warnings: list[str] = field(default_factory=list)


def _check_inputs(ref, quants, calib, data, bench_paths, out, tokenizer, samples, seq_len, batch_size, device,
                  what_ifs=False):
    if not quants and not bench_paths and not what_ifs:
        raise InputError("nothing to report", hint="pass --quant CKPT (repeatable), --bench bench.json and/or "
                                                   "--what-ifs")
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
                 device: str = "cpu", on_evaluate: Callable[[Path], None] | None = None,
                 what_ifs: bool = False) -> ReportResult:
    """Evaluate ``quants`` against ``ref`` on ``samples`` held-out windows (``data``, or the corpus's
    heldout split), add the calibration's heatmaps and any benchmark curves, and write report.json and
    report.html under ``out``. With a calibration, what a decode step moves at each batch size (the
    reference's and each checkpoint's formats, the calibration's routing); with ``what_ifs``, the router
    what-ifs measured on the reference over the same held-out windows. Warnings name what makes the
    figures less than held-out or complete."""
    _check_inputs(ref, quants, calib, data, bench_paths, out, tokenizer, samples, seq_len, batch_size, device,
                  what_ifs)
    warnings: list[str] = []
    cal = load_calib(calib) if calib else None
    if cal and data is not None and cal.get("data", {}).get("path") and \
            Path(cal["data"]["path"]).resolve() == Path(data).resolve():
        warnings.append(f"the held-out data {data} is the calibration data: these statistics are not held-out")
    ids = None
    if quants or what_ifs:
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
    wi = None
    if what_ifs:
        if on_evaluate:
            on_evaluate(Path(ref))
        wi = measure_what_ifs(load_engine(ref, device, pack_experts=False), ids, batch_size=batch_size)
    moves = _moves(ref, quants, cal, warnings) if cal else None
    heldout = None if ids is None else {
        "source": str(data) if data is not None else "corpus split 'heldout'", "samples": int(ids.shape[0]),
        "seq_len": int(ids.shape[1]), "tokens_scored": int(ids.shape[0] * (ids.shape[1] - 1)),
        "sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest()}
    reference = {"checkpoint": str(ref), "footprint": refp.footprint, "seconds": refp.seconds} if refp else None
    rep = build_report(calib=cal, reference=reference, evaluations=evals, bench=bench, heldout=heldout,
                       warnings=warnings, moves=moves, what_ifs=wi, calib_cost=load_cost(calib) if calib else None)
    return ReportResult(rep, render(rep, out), evals, heldout, warnings)


def _moves(ref, quants, cal: dict, warnings: list[str]) -> dict | None:
    """What a decode step moves at MOVES_BATCHES under the calibration's routing, with the reference's
    expert formats, and the bytes per step of each quantized checkpoint beside them."""
    try:
        out = None
        for i, ck in enumerate((ref, *quants)):
            cfg = load_config(checkpoint_dir_of(ck)[0])
            layout = ExpertLayout.from_checkpoint_config(cfg, str(ck))
            mv = what_it_moves(cfg, cfg.mapping, cfg.dtype, batches=MOVES_BATCHES, calib=cal, experts=layout)
            if out is None:
                out = {**mv, "checkpoints": []}
            out["checkpoints"].append({"name": "reference" if i == 0 else Path(ck).name,
                                       "bytes_per_step": [b["measured"]["weight_bytes"] for b in mv["batches"]]})
        return out
    except InputError as e:
        warnings.append(f"what a decode step moves is not shown: {e.render()}")
        return None
