"""calib.json: its layout version, how a calibration becomes one (``build_result``), and its shape,
checked before any policy or report reads it (``check_calib`` / ``validate_calib``).

A calibration names its layers, experts and formats; every table in it must then have exactly
that shape (``[num_layers][num_experts]`` of finite numbers, non-negative where they are counts,
shares or ΔKL), so that a hand-edited or truncated file is one message naming the key and the
row, not a KeyError or an IndexError deep inside the allocator."""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ..errors import InputError
from .formats import FORMATS
from .plan import FLOAT, format_obj

# Version 2: ΔKL per expert matrix (fc, proj); the expert-level ΔKL is their sum. Version 1 measured
# whole experts only, which matrix-granularity plans cannot use.
CALIB_VERSION = 2

MATRICES = ("fc", "proj")


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Checker:
    """Type and shape checks over one calib.json; each failure is one InputError naming the key."""

    def __init__(self, calib: dict, where: str | None):
        self.calib, self.where = calib, where
        self.L = self.E = 0

    def bad(self, key: str, what: str) -> InputError:
        return InputError(f"calib.json {key} {what}", where=self.where,
                          hint="the file is damaged or hand-edited; rerun `trtmoe calibrate`")

    def get(self, d: dict, key: str, path: str):
        if not isinstance(d, dict):
            raise self.bad(path.rsplit(".", 1)[0], f"must be an object, got {_kind(d)}")
        if key not in d:
            raise self.bad(path, "is missing")
        return d[key]

    def count(self, key: str, low: int = 1) -> int:
        v = self.get(self.calib, key, key)
        if not _is_int(v) or v < low:
            raise self.bad(key, f"must be an integer ≥ {low}, got {_kind(v)} {v!r:.40}")
        return v

    def table(self, v: Any, key: str, *, integer: bool = False) -> None:
        """``v`` must be [L][E] of finite non-negative numbers."""
        L, E = self.L, self.E
        if not isinstance(v, list):
            raise self.bad(key, f"must be a [{L}][{E}] table, got {_kind(v)}")
        if len(v) != L:
            raise self.bad(key, f"has {len(v)} rows, expected {L} (num_layers)")
        for l, row in enumerate(v):
            if not isinstance(row, list) or len(row) != E:
                got = f"{len(row)} values" if isinstance(row, list) else _kind(row)
                raise self.bad(key, f"row {l} has {got}, expected {E} (num_experts)")
            for e, x in enumerate(row):
                if not _is_num(x) or x < 0 or (integer and not float(x).is_integer()):
                    raise self.bad(key, f"[{l}][{e}] = {x!r:.40} must be a finite "
                                   f"{'count' if integer else 'number'} ≥ 0")

    def header(self) -> list[str]:
        """The model's shape, its MoE layers and the formats; returns the formats."""
        self.L, self.E = self.count("num_layers"), self.count("num_experts")
        k = self.count("top_k")
        if k > self.E:
            raise self.bad("top_k", f"= {k} exceeds num_experts = {self.E}")
        self.count("hidden_size")
        self.count("expert_intermediate_size")
        moe = self.get(self.calib, "moe_layers", "moe_layers")
        if not isinstance(moe, list) or not all(_is_int(x) for x in moe):
            raise self.bad("moe_layers", f"must be a list of layer indices, got {moe!r:.60}")
        if not all(0 <= x < self.L for x in moe) or len(set(moe)) != len(moe):
            raise self.bad("moe_layers", f"= {moe!r:.60} must be distinct layers in 0..{self.L - 1}")
        formats = self.get(self.calib, "formats", "formats")
        if not isinstance(formats, list) or not formats or not all(isinstance(f, str) for f in formats):
            raise self.bad("formats", f"must be a non-empty list of format names, got {formats!r:.60}")
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            raise self.bad("formats", f"names unknown format(s) {', '.join(map(repr, unknown))}")
        bpw = self.get(self.calib, "bits_per_weight", "bits_per_weight")
        for f in formats:
            v = self.get(bpw, f, f"bits_per_weight.{f}")
            if not _is_num(v) or v <= 0:
                raise self.bad(f"bits_per_weight.{f}", f"must be a positive number, got {v!r:.40}")
        return formats

    def routing(self) -> None:
        L, E = self.L, self.E
        routing = self.get(self.calib, "routing", "routing")
        tokens = self.get(routing, "tokens", "routing.tokens")
        if not _is_int(tokens) or tokens < 0:
            raise self.bad("routing.tokens", f"must be an integer ≥ 0, got {tokens!r:.40}")
        self.table(self.get(routing, "counts", "routing.counts"), "routing.counts", integer=True)
        self.table(self.get(routing, "share", "routing.share"), "routing.share")
        for key in ("entropy_nats", "load_imbalance"):
            v = routing.get(key, [0] * L)
            if not isinstance(v, list) or len(v) != L or not all(_is_num(x) for x in v):
                raise self.bad(f"routing.{key}", f"must be a list of {L} numbers (one per layer)")
        for key, ok in (("max_entropy_nats", _is_num), ("min_tokens_threshold", _is_int)):
            if key in routing and not ok(routing[key]):
                raise self.bad(f"routing.{key}", f"must be a number, got {routing[key]!r:.40}")
        for key in ("under_observed", "dead"):
            items = routing.get(key, [])
            if not isinstance(items, list) or not all(
                    isinstance(i, dict) and _is_int(i.get("layer")) and 0 <= i["layer"] < L
                    and _is_int(i.get("expert")) and 0 <= i["expert"] < E
                    and (key == "dead" or _is_int(i.get("tokens"))) for i in items):
                raise self.bad(f"routing.{key}", "must list {layer, expert" + (", tokens" if key != "dead" else "")
                               + "} objects inside the model")

    def sensitivity(self, formats: list[str]) -> None:
        sens = self.get(self.calib, "sensitivity", "sensitivity")
        dkl = self.get(sens, "delta_kl", "sensitivity.delta_kl")
        for f in formats:
            self.table(self.get(dkl, f, f"sensitivity.delta_kl.{f}"), f"sensitivity.delta_kl.{f}")
        mats = self.get(sens, "matrices", "sensitivity.matrices")
        for m in MATRICES:
            md = self.get(self.get(mats, m, f"sensitivity.matrices.{m}"), "delta_kl",
                          f"sensitivity.matrices.{m}.delta_kl")
            for f in formats:
                self.table(self.get(md, f, f"sensitivity.matrices.{m}.delta_kl.{f}"),
                           f"sensitivity.matrices.{m}.delta_kl.{f}")
        if "stacked" in sens:
            self.stacked(sens["stacked"], formats)

    def stacked(self, st: Any, formats: list[str]) -> None:
        """The optional ΔKL of formats as TensorRT-LLM's stacked layout rounds them: the same tables."""
        fs = self.get(st, "formats", "sensitivity.stacked.formats")
        if not isinstance(fs, list) or not all(isinstance(f, str) and f in formats for f in fs):
            raise self.bad("sensitivity.stacked.formats", f"must list measured formats, got {fs!r:.60}")
        for f in fs:
            self.table(self.get(self.get(st, "delta_kl", "sensitivity.stacked.delta_kl"), f,
                                f"sensitivity.stacked.delta_kl.{f}"), f"sensitivity.stacked.delta_kl.{f}")
            for m in MATRICES:
                key = f"sensitivity.stacked.matrices.{m}.delta_kl"
                md = self.get(self.get(self.get(st, "matrices", "sensitivity.stacked.matrices"), m,
                                       f"sensitivity.stacked.matrices.{m}"), "delta_kl", key)
                self.table(self.get(md, f, f"{key}.{f}"), f"{key}.{f}")


def validate_calib(calib: dict, where: str | None = None) -> dict:
    """Raise InputError naming the key (and row) unless every part of ``calib`` that trtmoe reads
    has its type and shape. ``calib`` is already known to be an object of the current version."""
    check = _Checker(calib, where)
    formats = check.header()
    check.routing()
    check.sensitivity(formats)
    return calib


def stacked_view(calib: dict) -> dict:
    """``calib`` with the ΔKL of each format that ``sensitivity.stacked`` measured replaced by that
    measurement (what TensorRT-LLM's stacked layout writes): the tensorrt-llm target plans on it. A
    calibration without the block (round-to-nearest or error-feedback-only roundings, where both layouts
    write the same weights, or the exact method) is returned unchanged."""
    st = calib["sensitivity"].get("stacked")
    if not st:
        return calib
    sens = dict(calib["sensitivity"])
    sens["delta_kl"] = {**sens["delta_kl"], **st["delta_kl"]}
    sens["matrices"] = {m: {**sens["matrices"][m], "delta_kl": {**sens["matrices"][m]["delta_kl"],
                                                                **st["matrices"][m]["delta_kl"]}}
                        for m in MATRICES}
    return {**calib, "sensitivity": sens}


def build_result(eng, formats, stats: dict, tokens: int, min_tokens: int, flagged: list,
                 sensitivity: dict) -> dict:
    """The calib.json dict (the layout ``measure`` returns) from routing statistics (``counts``,
    ``weight_mass`` [L, E], ``entropy_sum`` [L]) and a ready ``sensitivity`` block."""
    c = eng.cfg
    L, E, k = c.num_layers, c.num_experts, c.top_k
    moe_layers = [l for l in range(L) if c.moe_layers[l]]
    counts, mass = stats["counts"], stats["weight_mass"]
    load = counts.double()
    I, H = c.expert_intermediate_size, c.hidden_size
    return {
        "version": CALIB_VERSION,
        "architecture": c.family,
        "num_layers": L, "num_experts": E, "top_k": k, "moe_layers": moe_layers,
        "hidden_size": H, "expert_intermediate_size": I, "dtype": str(eng.dtype).replace("torch.", ""),
        "weights_per_expert": 3 * I * H,
        "formats": list(formats),
        "bits_per_weight": {f: _expert_bpw(f, I, H, eng.dtype) for f in (FLOAT, *formats)},
        "routing": {
            "tokens": tokens,
            "counts": counts.tolist(),
            "share": (counts.double() / (tokens * k)).tolist(),
            "weight_mass": mass.tolist(),
            "entropy_nats": [float(stats["entropy_sum"][l]) / tokens for l in range(L)],
            "max_entropy_nats": math.log(E),
            "load_imbalance": [float(load[l].max() / load[l].mean()) if load[l].sum() > 0 else 0.0
                               for l in range(L)],
            "min_tokens_threshold": min_tokens,
            "under_observed": flagged,
            "dead": [{"layer": l, "expert": e} for l in moe_layers for e in range(E) if counts[l, e] == 0],
        },
        "sensitivity": sensitivity,
    }


def _expert_bpw(name: str, I: int, H: int, dtype: torch.dtype) -> float:
    fmt = format_obj(name, dtype)
    scale = torch.empty((), dtype=dtype).element_size()
    bits = 8 * (fmt.weight_bytes(2 * I, H, 1, scale) + fmt.weight_bytes(H, I, 1, scale))
    return bits / (3 * I * H)


class NonFinite(ValueError):
    """A calib.json number that is NaN or infinite (JSON has no such numbers; Python writes them)."""


def parse_calib_json(text: str):
    """calib.json's text parsed; a NaN, Infinity or -Infinity anywhere in it raises NonFinite naming
    where (e.g. ``sensitivity.delta_kl.int8.1.0``)."""
    obj = json.loads(text)
    bad = non_finite_path(obj)
    if bad:
        raise NonFinite(f"holds a NaN or infinite number at {bad}, which no calibration has")
    return obj


def non_finite_path(obj, path: str = "") -> str | None:
    """Where ``obj`` (calib.json's dict) holds a NaN or infinite float, or None."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (path or "value")
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        got = non_finite_path(v, f"{path}.{k}" if path else str(k))
        if got:
            return got
    return None


def check_calib(calib: dict, where: str | None = None) -> dict:
    """Raise InputError unless ``calib`` has this trtmoe's calib.json layout (CALIB_VERSION)."""
    v = calib.get("version")
    if v != CALIB_VERSION:
        newer = isinstance(v, int) and v > CALIB_VERSION
        raise InputError(f"calib.json has layout version {v}; this trtmoe reads version {CALIB_VERSION} "
                         "(ΔKL per expert matrix, fc and proj)", where=where,
                         hint="it was written by a newer trtmoe" if newer else
                         "recalibrate: trtmoe calibrate MODEL --data TEXT -o DIR")
    return validate_calib(calib, where)
