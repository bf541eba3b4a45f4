"""``trtmoe calibrate``: routing statistics and measured per-matrix sensitivity.

By default (``--sensitivity fisher``) the ΔKL of every expert matrix is a second-order estimate from
one forward and one backward pass over the calibration set (see sensitivity.py); its cost does not
grow with the number of experts. ``--sensitivity exact``, described here, measures it end to end and
is the oracle that estimate is validated against.

Exact sensitivity of matrix m ∈ {fc, proj} of expert e (layer l) to format f is the end-to-end ΔKL: the
mean over calibration tokens of KL(p_ref ‖ p_q), where p_q is the model's next-token distribution
with only that matrix quantized (through the format's own quantize + packed ``linear``; the other
matrix and every other expert stay float). The residual stream entering layer l is cached from the
reference pass, so each measurement reruns layers l..L-1, and only over the sequences in which some
token routes to e (the others reproduce the reference exactly).

An expert's sensitivity (what expert- and layer-granularity plans and the report use) is the sum
fc + proj: on the trained fixture the measured sum is ~1.07× the ΔKL of quantizing the whole expert
at once, additive enough for the allocator, and it saves measuring the whole expert as well.

Experts the router seldom picks see few calibration tokens, so their measured ΔKL says little about
text that does route to them. For those we also estimate ΔKL from the matrix's output error on *all*
of the layer's calibration inputs (routing ignored), scaled by a per-(layer, format, matrix)
coefficient fitted on the well-covered experts and by a floor routing share, and keep the larger of
measured and estimated.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..checkpoint.atomic import (_MARK, atomic_directory, foreign_entry, own_directory, pid_alive, recover_leftovers,
                                 remove_tree)
from ..checkpoint.manifest import dump_json, write_manifest
from ..checkpoint.writer import convert
from ..data import load_texts
from ..errors import InputError, TrtmoeError, UnsupportedError
from ..hf.adapters import adapter_for
from ..hf.hashing import sha256_file
from ..hf.reader import model_context, read_json, resolve_model_path
from ..runtime.engine import EmbeddedEngine
from ..runtime.experts import ExpertBank, FloatExperts
from ..runtime.load import find_tokenizer_dir, load_tokenizer
from ..targets import TARGETS, names as target_names
from . import ENGINE_PATH_NAMES, QUANTIZED_NAMES, awq, fp_gptq
from .calib_schema import (CALIB_VERSION, NonFinite, _expert_bpw, build_result,  # noqa: F401 - calib.json's home
                           check_calib, non_finite_path, parse_calib_json)
from .formats import FORMATS
from .plan import FLOAT, MATRICES, expert_shape_problem, format_obj
from .sensitivity import (DEFAULT_SENSITIVITY, SENSITIVITY_METHODS, PhaseClock, Progress, amax_json,
                          check_float_banks, fisher_measure, layer_input_amax, owned_marker)
from .stream import StreamedModel, memory_plan, stream_measure

DEFAULT_FORMATS = ENGINE_PATH_NAMES
_FLOAT_NAMES = ("fp16", "bf16", "fp32")
# The measured cost of a calibration (seconds per phase, the ratio to one forward over the same tokens),
# beside calib.json and hashed by the manifest; calib.json itself holds nothing measured in seconds, so
# that the same inputs give the same bytes.
COST_FILE = "calib.cost.json"
COST_VERSION = 1


@dataclass(frozen=True)
class CalibrationSettings:
    """What ``calibrate`` measures and how: the ``trtmoe calibrate`` options (``from_config`` builds them
    from the command line and YAML config). Each field is described in ``calibrate``'s docstring."""

    samples: int = 32
    seq_len: int = 128
    formats: tuple[str, ...] = DEFAULT_FORMATS
    min_tokens: int = 16
    batch_size: int = 8
    tokenizer: str | Path | None = None
    text_field: str = "text"
    add_bos: bool | None = None
    rounding: str = awq.DEFAULT_ROUNDING
    cross_fit: bool = True
    sensitivity: str = DEFAULT_SENSITIVITY
    device: str = "cpu"
    probe: str = "gaussian"
    max_gram_in: int = awq.MAX_GRAM_IN
    max_input_tokens: int = awq.MAX_INPUT_TOKENS
    target: str = "embedded"
    runner: str = "auto"

    def __post_init__(self):
        if not isinstance(self.formats, tuple):  # a list from a config: kept hashable and immutable
            object.__setattr__(self, "formats", tuple(self.formats))

    @classmethod
    def from_config(cls, section: dict) -> "CalibrationSettings":
        """The settings of a resolved ``calibrate`` config section (``trtmoe.config``: the command line
        over the YAML config over the defaults); keys it leaves out keep their defaults."""
        names = {f.name for f in fields(cls)}
        given = {("text_field" if k == "field" else k): v for k, v in section.items() if k != "data"}
        unknown = set(given) - names
        if unknown:
            raise InputError(f"unknown calibration setting(s): {', '.join(sorted(unknown))}")
        if given.get("formats") is None:
            given.pop("formats", None)
        if given.get("tokenizer"):
            given["tokenizer"] = Path(given["tokenizer"])
        return cls(**given)

    @property
    def gram(self) -> dict:
        """The error-feedback roundings' storage limits, as the activation statistics take them."""
        return {"max_gram_in": self.max_gram_in, "max_input_tokens": self.max_input_tokens}


def token_batches(texts: list[str], tokenizer, samples: int, seq_len: int) -> torch.Tensor:
    """Concatenate the texts' tokens (EOS between documents) and cut ``samples`` windows of
    ``seq_len`` tokens, evenly spaced over the stream. Raises InputError if there is too little."""
    stream: list[int] = []
    for t in texts:
        stream.extend(tokenizer.encode(t))
        if tokenizer.eos_id is not None:
            stream.append(tokenizer.eos_id)
    if len(stream) < seq_len + 1:
        raise InputError(f"calibration data has {len(stream)} tokens; need at least {seq_len + 1} "
                         f"for one {seq_len}-token sample")
    n_windows = len(stream) // seq_len
    samples = min(samples, n_windows)
    step = n_windows / samples
    rows = [stream[int(i * step) * seq_len:int(i * step) * seq_len + seq_len] for i in range(samples)]
    return torch.tensor(rows, dtype=torch.long)


def kl_per_token(ref_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref ‖ p) per position, nats, float64 and never negative (a KL is ≥ 0; float32 rounding
    of two nearly equal distributions can otherwise give -1e-9). ref_logp and logits [..., V]."""
    logq = logits.float().log_softmax(-1)
    return (ref_logp.exp() * (ref_logp - logq)).double().sum(-1).clamp_min_(0.0)


class _MatrixSwapped(ExpertBank):
    """A bank where expert ``e``'s fc and/or proj run from packed bytes (``(format, packed)``, None =
    the float matrix, computed exactly as ``FloatExperts`` does); every other expert as before."""

    def __init__(self, base: FloatExperts, e: int, fc=None, proj=None):
        self.base, self.e, self.fc, self.proj = base, e, fc, proj

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if e != self.e:
            return self.base.forward(e, x)
        mm = self.base.matmul
        h = self.base.fc_out(e, x) if self.fc is None else self.fc[0].linear(x, self.fc[1], mm)
        up, gate = h.chunk(2, dim=-1)
        a = F.silu(gate) * up
        return self.base.proj_out(e, a) if self.proj is None else self.proj[0].linear(a, self.proj[1], mm)

    def format_of(self, e: int) -> str:
        if e != self.e:
            return self.base.format_of(e)
        fc, proj = (self.base.fmt if m is None else m[0].name for m in (self.fc, self.proj))
        return fc if fc == proj else f"fc:{fc},proj:{proj}"


def calibrate(model: str | Path, data: str | Path, out_dir: str | Path | None = None,
              settings: CalibrationSettings | None = None, *, progress: Callable[[str, int, int], None] | None = None,
              notes: list[str] | None = None, force: bool = False, **options) -> dict:
    """Measure routing statistics and per-(layer, expert, matrix, format) ΔKL on calibration text.

    ``model`` is an HF MoE directory (converted to a scratch single-rank checkpoint in its own dtype);
    ``data`` a text file, directory or JSONL. ``settings`` (a ``CalibrationSettings``; ``options`` name
    single fields of it, over ``settings`` or the defaults) say what is measured and how, below. With
    ``out_dir`` the result is written atomically as a calibration artifact (calib.json, calib.cost.json
    and manifest.json; ``force`` replaces an existing one); the scratch checkpoint lives in the output's
    hidden partial sibling (or, without ``out_dir``, a pid-marked directory in the system temp dir), so a
    killed run's leftovers are removed by the next run. Formats whose packing the model's shapes do not
    allow are skipped; each skip, and which BOS/EOS were used, is appended to ``notes`` and recorded in
    calib.json.

    Settings: ``samples`` windows of ``seq_len`` tokens, cut from ``data`` (JSONL: its ``text_field``)
    tokenized by ``tokenizer`` (default: the model's); ``add_bos`` overrides the tokenizer's own choice.
    ``formats``: the candidate formats; ``min_tokens``: experts routed fewer tokens are flagged and their
    ΔKL also estimated; ``batch_size``: sequences per forward. ``rounding`` is how the int4 formats are
    rounded when their ΔKL is measured (the routed-token activation statistics awq needs are always
    collected, into activations.safetensors); ``cross_fit`` (fisher, a rounding other than rtn): each
    candidate fitted to the calibration rows is scored on the sequences it was not fitted to.
    ``sensitivity``: "fisher" (one forward and backward pass, see sensitivity.py, with the random
    ``probe`` "gaussian" or "sample"; resumable: a killed or interrupted run to the same output continues
    from its per-batch and per-layer progress) or "exact" (end-to-end ΔKL per matrix and format, the
    oracle). ``device``: "cpu" or "cuda".
    Under the error-feedback roundings (gptq, awq_gptq) each expert matrix with at most ``max_gram_in``
    inputs has its input Gram matrix stored; for the larger ones the MoE layers' input rows (at most
    ``max_input_tokens`` per layer) are stored in ``moe-inputs/`` and the Gram matrix is rebuilt from
    them when the matrix is rounded. Under awq and awq_gptq the pre-quant scales and clips the searches
    chose are kept in ``recipes/`` (one file per MoE layer), which ``convert`` applies instead of
    searching again.
    ``target`` "tensorrt-llm" (Fisher only) also scores the group-int4 formats as TensorRT-LLM's
    stacked layout writes them under awq / awq_gptq (one pre-quant scale per MoE layer and matrix kind):
    calib.json's ``sensitivity.stacked``, which ``convert --target tensorrt-llm`` plans on.
    ``runner``: "engine" converts the model to a scratch checkpoint and runs the embedded engine over the
    whole model; "stream" runs transformers' own modelling code one decoder layer at a time (stream.py:
    any transformers MoE, memory independent of depth, Fisher only); "auto" the engine for the
    architectures it implements and the stream for the others.

    Returns the calib.json dict, with the measured cost (what calib.cost.json holds: seconds per phase
    and the ratio to one forward pass over the same tokens, see ``cost_record``) under ``"cost"``."""

    s = replace(settings if settings is not None else CalibrationSettings(), **options)
    _check_options(s.sensitivity, s.device, s.formats, s.min_tokens, s.max_gram_in, s.max_input_tokens, s.target)
    runner = resolve_runner(model, s.runner, s.sensitivity)
    # Windows past the model's context would measure positions the model was never defined for;
    # they are refused rather than clipped, so that --seq-len always means what it says.
    context = model_context(model) if runner == "engine" else _config_context(model)
    if s.seq_len > context:
        raise InputError(f"--seq-len {s.seq_len} is longer than the model's context (max_position_embeddings "
                         f"{context})", hint=f"choose --seq-len {context} or less")
    notes = notes if notes is not None else []
    clock = PhaseClock(s.device)
    with clock("data"):
        texts = load_texts(data, field=s.text_field)
        tok_dir = find_tokenizer_dir(s.tokenizer or model)
        tok = load_tokenizer(tok_dir)
        special = _special_tokens(tok, tok_dir, s.add_bos)
        tok.add_bos = special["add_bos"]
        ids = token_batches(texts, tok, s.samples, s.seq_len)
    notes.append(special["note"])
    data_hash = hashlib.sha256(ids.numpy().tobytes()).hexdigest()
    if runner == "stream":
        return _calibrate_streamed(model, data, out_dir, ids, data_hash, special, notes, s, progress=progress,
                                   force=force, clock=clock)
    inputs = [p for p in (model, data, s.tokenizer) if p is not None]
    with _workspace(out_dir, force, inputs=inputs, notes=notes) as work:
        ck = work / "scratch-checkpoint"
        with clock("io"):
            if ck.exists():
                shutil.rmtree(ck)
            convert(model, ck)
            source = json.loads((ck / "manifest.json").read_text()).get("source")
            eng = EmbeddedEngine.from_checkpoint(ck, device=s.device, pack_experts=False)
        usable, skipped = applicable_formats(s.formats, eng.cfg.hidden_size, eng.cfg.expert_intermediate_size)
        for f, why in skipped.items():
            notes.append(f"{f} skipped: {why}")
        if not usable:
            raise InputError("none of the candidate formats can store this model's experts: "
                             + "; ".join(skipped.values()), hint="choose --formats int8,int4")
        acts = awq.ActivationStats(inputs_dir=work / awq.INPUTS_DIR)  # MoE inputs stream there per layer
        if s.sensitivity == "exact":
            result = measure(eng, ids, formats=usable, min_tokens=s.min_tokens, batch_size=s.batch_size,
                             progress=progress, rounding=s.rounding, activations=acts, clock=clock, **s.gram)
            result["sensitivity"]["method"] = "exact"
            result["sensitivity"]["cross_fitted"] = False  # measured end to end on the rows the roundings fitted
        else:
            # Resumable progress is keyed by everything the measurement depends on.
            key = [CALIB_VERSION, source, data_hash, list(usable), s.min_tokens, s.batch_size, s.rounding, s.probe,
                   str(s.device), s.max_input_tokens] + ([s.max_gram_in] if s.rounding in awq.ERROR_FEEDBACK else []) \
                + (["stacked"] if TARGETS[s.target].stacked_scoring else []) + ([] if s.cross_fit else ["in-sample"])
            result = _fisher(eng, ids, usable, work, acts, key, min_tokens=s.min_tokens, batch_size=s.batch_size,
                             progress=progress, rounding=s.rounding, probe=s.probe, notes=notes, gram=s.gram,
                             stacked=TARGETS[s.target].stacked_scoring, cross_fit=s.cross_fit, clock=clock)
        # One forward of the same engine over the same tokens, timed apart: what the cost is a multiple of.
        forward = engine_forward_seconds(eng, ids, s.batch_size)
        del eng
        with clock("io"):
            shutil.rmtree(ck)
        result["skipped_formats"] = skipped
        result["tokens"] = {k: special[k] for k in ("bos_id", "eos_id", "add_bos", "add_bos_from")}
        result["data"] = {"path": _identity(data), "samples": int(ids.shape[0]), "seq_len": int(ids.shape[1]),
                          "tokens": int(ids.numel()), "sha256": data_hash}
        result["model"] = _identity(model)
        what = ("one forward of the embedded engine over the same tokens, timed after the calibration "
                "(not part of its total)")
        result = _finish(work if out_dir is not None else None, result, acts, clock, source=source, runner="engine",
                         settings=s, forward={**forward, "what": what, "in_total": False})
    return result


def engine_forward_seconds(eng: EmbeddedEngine, ids: torch.Tensor, batch_size: int) -> dict[str, float]:
    """Wall and CPU seconds of one forward of ``eng`` over ``ids`` (``batch_size`` sequences at a time), the
    logits computed and dropped; the engine's routing statistics are reset afterwards."""
    clock = PhaseClock(eng.device)
    with torch.inference_mode(), clock("forward"):
        for b in ids.split(batch_size):
            eng.logits(b)
    eng.reset_routing_stats()
    return clock.phases()["forward"]


def _finish(work: Path | None, result: dict, acts: "awq.ActivationStats", clock: PhaseClock, *, source,
            runner: str, settings: CalibrationSettings, forward: dict | None) -> dict:
    """Write the artifact into ``work`` (None: nothing to write), the time it takes counted as I/O; returns
    ``result`` with the cost record under "cost"."""
    if work is not None:
        with clock("io"):
            acts.save(work / awq.ACT_FILE)
    if awq.has_float_rounding(result.get("formats", ())):
        # What the float formats' ΔKL was measured under (their codes follow the rounding since this key
        # exists; a calibration without it measured them rounded to nearest whatever its rounding says).
        result["float_rounding"] = settings.rounding
    if awq.has_w4a8(result.get("formats", ())):
        # The same for W4A8-AWQ, whose error-feedback codes (gptq / awq_gptq) came later than its search.
        result["w4a8_rounding"] = settings.rounding
    cost = cost_record(clock, forward, runner=runner, method=result["sensitivity"].get("method", "exact"),
                       rounding=settings.rounding, tokens=int(result["data"]["tokens"]))
    if work is not None:
        cost = write_calibration(work, result, source=source, cost=cost)
    return {**result, "cost": cost}


def cost_record(clock: PhaseClock, forward: dict | None, *, runner: str, method: str, rounding: str,
                tokens: int) -> dict:
    """calib.cost.json: the measured seconds of each phase of a calibration (``clock``), their total, one
    forward pass over the same ``tokens`` (``forward``: wall and CPU seconds, what it was, whether the total
    includes it) and the total's ratio to it. The ratio is taken in CPU seconds on a CPU (every thread of
    the process counted) and in device-synchronised wall seconds on CUDA (``unit``); None when no forward
    was measured (a streamed run resumed after its forward pass)."""
    unit = "wall_seconds" if clock.device.type == "cuda" else "cpu_seconds"
    phases = clock.phases()
    total = {k: sum(p[k] for p in phases.values()) for k in ("wall_seconds", "cpu_seconds")}
    ratio = total[unit] / forward[unit] if forward and forward[unit] > 0 else None
    return {"tool": "trtmoe", "kind": "calibration-cost", "version": COST_VERSION, "runner": runner,
            "method": method, "rounding": rounding, "device": str(clock.device),
            "torch_threads": torch.get_num_threads(), "tokens": tokens, "unit": unit, "total": total,
            "phases": phases, "forward": forward, "ratio_to_forward": ratio, "resumed": clock.resumed}


# The phases of calib.cost.json, in the order a calibration runs them, and what each one holds.
COST_PHASES = {
    "data": "reading and tokenizing the calibration text",
    "io": "model and checkpoint files, progress and artifact files",
    "boundaries": "each layer's call arguments (the model's own forward, layers stood in for)",
    "forward": "forward passes",
    "backward": "backward passes (the Fisher probe's gradient)",
    "statistics": "activation statistics the searches use",
    "searches": "quantizing every candidate (AWQ / GPTQ searches included)",
    "scoring": "ΔKL of every expert matrix and format",
}


def phase_order(phases: dict) -> list[tuple[str, dict]]:
    """``phases`` (calib.cost.json's) in the order a calibration runs them (``COST_PHASES``), others last."""
    rank = {k: i for i, k in enumerate(COST_PHASES)}
    return sorted(phases.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0]))


def seconds(x: float) -> str:
    """Seconds to print: one decimal from a second on, three significant digits below."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def cost_summary(cost: dict) -> str:
    """One line: what the calibration took and its ratio to one forward over the same tokens."""
    unit = cost["unit"]
    tot, fwd = cost["total"], cost.get("forward")
    took = (f"{seconds(tot['cpu_seconds'])} CPU-s ({seconds(tot['wall_seconds'])} s wall)" if unit == "cpu_seconds"
            else f"{seconds(tot['wall_seconds'])} s on {cost['device']} ({seconds(tot['cpu_seconds'])} CPU-s)")
    line = f"calibration took {took}"
    if cost.get("ratio_to_forward") is not None:
        line += (f" = {cost['ratio_to_forward']:.1f}× one forward over the same {cost['tokens']} tokens "
                 f"({seconds(fwd[unit])} {'CPU-s' if unit == 'cpu_seconds' else 's'}"
                 f"{', timed apart' if not fwd.get('in_total') else ''})")
    else:
        line += " (no forward over the calibration tokens ran in this process: it resumed after it)"
    if cost.get("resumed"):
        line += "; resumed: this process's part only"
    return line


def load_cost(path: str | Path) -> dict | None:
    """The calib.cost.json beside ``path``'s calib.json (``path``: the file or its directory); None when
    the calibration has none (written before it was recorded), InputError when it is not a cost record."""
    p = Path(path)
    f = (p if p.is_dir() else p.parent) / COST_FILE
    if not f.is_file():
        return None
    try:
        cost = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InputError(f"{COST_FILE} is not readable JSON ({e})", where=str(f)) from None
    problem = _cost_problem(cost)
    if problem:
        raise InputError(f"{COST_FILE} is not a calibration cost record ({problem})", where=str(f),
                         hint="recalibrate, or remove the file (the calibration itself is calib.json)")
    return cost


def _cost_problem(cost) -> str | None:
    """What makes ``cost`` other than a ``cost_record`` (None when it is one)."""
    if not isinstance(cost, dict) or cost.get("kind") != "calibration-cost":
        return "its kind is not calibration-cost"

    def seconds_pair(d) -> bool:
        return isinstance(d, dict) and all(
            isinstance(d.get(k), (int, float)) and not isinstance(d.get(k), bool) and math.isfinite(d[k]) and d[k] >= 0
            for k in ("wall_seconds", "cpu_seconds"))

    if cost.get("unit") not in ("wall_seconds", "cpu_seconds"):
        return f"unit {cost.get('unit')!r}"
    for k in ("runner", "method", "rounding", "device"):
        if not isinstance(cost.get(k), str):
            return f"{k} is not a string"
    for k in ("tokens", "torch_threads"):
        if not isinstance(cost.get(k), int) or isinstance(cost.get(k), bool):
            return f"{k} is not an integer"
    if not seconds_pair(cost.get("total")):
        return "total is not wall and CPU seconds"
    phases = cost.get("phases")
    if not isinstance(phases, dict) or not all(isinstance(k, str) and seconds_pair(v) for k, v in phases.items()):
        return "phases are not wall and CPU seconds by name"
    fwd = cost.get("forward")
    if fwd is not None and not (seconds_pair(fwd) and isinstance(fwd.get("in_total"), bool)):
        return "forward is not wall and CPU seconds"
    ratio = cost.get("ratio_to_forward")
    if ratio is not None and (not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not math.isfinite(ratio)):
        return "ratio_to_forward is not a number"
    return None


RUNNERS = ("auto", "engine", "stream")


def resolve_runner(model: str | Path, runner: str, sensitivity: str) -> str:
    """"engine" or "stream" for ``runner`` (see ``calibrate``); InputError for a combination that cannot run."""
    if runner not in RUNNERS:
        raise InputError(f"unknown runner {runner!r}", hint="use auto, engine or stream")
    if runner == "auto":
        try:
            adapter_for(read_json(resolve_model_path(model) / "config.json"))
            runner = "engine"
        except UnsupportedError:
            runner = "stream"
        except (OSError, ValueError, TrtmoeError):
            runner = "engine"  # the engine path reports what is wrong with the model
    if runner == "stream" and sensitivity != "fisher":
        raise InputError(f"--sensitivity {sensitivity} reruns the whole model per expert matrix; the layer-streamed "
                         "runner measures the fisher sensitivity only",
                         hint="use --sensitivity fisher, or --runner engine for an architecture the engine implements")
    return runner


def _config_context(model: str | Path) -> int:
    """max_position_embeddings of a config.json the engine's adapters need not know (or of its text config)."""
    path = resolve_model_path(model) / "config.json"
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise InputError("config.json does not hold an object", where=str(path))
    n = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise InputError(f"max_position_embeddings must be a positive integer, got {n!r}", where=str(path))
    return n or 1 << 30


def _calibrate_streamed(model, data, out_dir, ids, data_hash, special, notes, s: CalibrationSettings, *, progress,
                        force, clock: PhaseClock) -> dict:
    """``calibrate`` through transformers' modelling code, one decoder layer at a time (stream.py)."""
    if s.rounding not in awq.ROUNDINGS:
        raise InputError(f"unknown rounding {s.rounding!r}", hint=awq.ROUNDING_HINT)
    mdir = resolve_model_path(model)
    with clock("io"):
        sm = StreamedModel(mdir, device=s.device)
    c = sm.cfg
    usable, skipped = applicable_formats(s.formats, c.hidden_size, c.expert_intermediate_size)
    for f, why in skipped.items():
        notes.append(f"{f} skipped: {why}")
    if not usable:
        raise InputError("none of the candidate formats can store this model's experts: "
                         + "; ".join(skipped.values()), hint="choose --formats int8,int4")
    N, T = ids.shape
    plan = memory_plan(sm, N * T, min(s.batch_size, N) * T, T, rounding=s.rounding, cross_fit=s.cross_fit,
                       copies=sm.hidden_copies(ids), carried_per_token=sm.carried_bytes_per_token(ids))
    parts = ", ".join(f"{k.replace('_', ' ')} {v / 2**30:.2f}" for k, v in plan["parts"].items())
    notes.append(f"layer-streamed calibration on {sm.device} in {str(sm.compute_dtype).replace('torch.', '')}: "
                 f"needs about {plan['total'] / 2**30:.2f} GiB at its peak ({parts} GiB; "
                 + ("the carried layer outputs grow with the layers that hand them on, the rest is "
                    if "carried_outputs" in plan["parts"] else "")
                 + f"independent of the number of layers), {plan['available'] / 2**30:.2f} GiB available")
    if plan["total"] > plan["available"]:
        raise InputError(f"layer-streamed calibration needs about {plan['total'] / 2**30:.2f} GiB ({parts} GiB) and "
                         f"{plan['available'] / 2**30:.2f} GiB is available",
                         hint="use fewer --samples or a smaller batch, or a device with more memory")
    with clock("io"):
        source = {"name": mdir.name, "architecture": (getattr(sm.config, "architectures", None) or ["?"])[0],
                  "files": {f.name: sha256_file(f) for f in sorted(set(sm.files.values()))}}
    inputs = [p for p in (model, data, s.tokenizer) if p is not None]
    with _workspace(out_dir, force, inputs=inputs, notes=notes) as work:
        acts = awq.ActivationStats(inputs_dir=work / awq.INPUTS_DIR)
        key = [CALIB_VERSION, "stream", source, data_hash, list(usable), s.min_tokens, s.batch_size, s.rounding,
               s.probe, str(s.device), s.max_input_tokens, str(sm.compute_dtype)] \
            + ([s.max_gram_in] if s.rounding in awq.ERROR_FEEDBACK else []) \
            + (["stacked"] if TARGETS[s.target].stacked_scoring else []) + ([] if s.cross_fit else ["in-sample"])
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        result = stream_measure(sm, ids, formats=usable, min_tokens=s.min_tokens, batch_size=s.batch_size,
                                progress=progress, work=work / _PROGRESS, key=digest, probe=s.probe,
                                rounding=_AwqRounding(acts, s.rounding, stacked=TARGETS[s.target].stacked_scoring,
                                                      cross_fit=s.cross_fit, **s.gram),
                                notes=notes, clock=clock)
        shutil.rmtree(work / _PROGRESS, ignore_errors=True)
        result["rounding"] = s.rounding
        result["activations"] = acts.summary(s.max_input_tokens)
        result["skipped_formats"] = skipped
        result["tokens"] = {k: special[k] for k in ("bos_id", "eos_id", "add_bos", "add_bos_from")}
        result["data"] = {"path": _identity(data), "samples": int(N), "seq_len": int(T), "tokens": int(ids.numel()),
                          "sha256": data_hash}
        result["model"] = _identity(model)
        # The layer-streamed forward over the calibration tokens is the run's own first pass (its
        # boundaries and forward phases); a run resumed after it has none.
        ran = [clock.phases()[p] for p in ("boundaries", "forward") if p in clock.wall]
        forward = None
        if "forward" in clock.wall and not clock.resumed:
            forward = {k: sum(p[k] for p in ran) for k in ("wall_seconds", "cpu_seconds")}
            forward.update(what="the run's own layer-streamed forward over the same tokens (its boundaries and "
                                "forward phases; part of the total)", in_total=True)
        result = _finish(work if out_dir is not None else None, result, acts, clock, source=source, runner="stream",
                         settings=s, forward=forward)
    return result


def _check_options(sensitivity: str, device: str, formats, min_tokens: int, max_gram_in: int,
                   max_input_tokens: int, target: str = "embedded") -> None:
    """InputError for an option ``calibrate`` cannot run with (before any work is done)."""
    if not formats:
        raise InputError("no candidate formats given (--formats is empty)",
                         hint="name at least one, e.g. --formats int8,int4_g128, or leave the option out for all")
    scored = target_names(calibrates=True)
    if target not in scored:
        raise InputError(f"unknown target {target!r}", hint=f"use {' or '.join(scored)}")
    if TARGETS[target].stacked_scoring and sensitivity == "exact":
        other = next(n for n in scored if not TARGETS[n].stacked_scoring)
        raise InputError(f"--target {target} scores the stacked layout with the fisher sensitivity only",
                         hint=f"use --sensitivity fisher, or --target {other}")
    if sensitivity not in SENSITIVITY_METHODS:
        raise InputError(f"unknown sensitivity method {sensitivity!r}", hint="use fisher or exact")
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise InputError(f"unknown device {device!r}", hint="use cpu or cuda")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available", hint="use --device cpu")
    for f in formats:
        if f not in FORMATS or f in _FLOAT_NAMES:
            raise InputError(f"unknown candidate format {f!r}",
                             hint="choose from " + ", ".join(n for n in FORMATS if n not in _FLOAT_NAMES))
    if min_tokens < 0:
        raise InputError(f"--min-tokens must be ≥ 0, got {min_tokens}")
    if max_gram_in < 0 or max_input_tokens < 1:
        raise InputError(f"max_gram_in must be ≥ 0 and max_input_tokens ≥ 1, got {max_gram_in} and "
                         f"{max_input_tokens}")


def _fisher(eng: EmbeddedEngine, ids: torch.Tensor, usable, work: Path, acts: "awq.ActivationStats", key: list, *,
            min_tokens: int, batch_size: int, progress, rounding: str, probe: str, notes: list[str],
            gram: dict, stacked: bool = False, cross_fit: bool = True, clock: PhaseClock | None = None) -> dict:
    """The Fisher measurement of ``calibrate`` (its progress in the workspace, resumed when ``key``
    matches), with the rounding and activation statistics recorded; ``clock`` receives its phases' seconds."""
    if rounding not in awq.ROUNDINGS:
        raise InputError(f"unknown rounding {rounding!r}", hint=awq.ROUNDING_HINT)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    result = fisher_measure(eng, ids, formats=usable, min_tokens=min_tokens, batch_size=batch_size,
                            progress=progress, work=work / _PROGRESS, key=digest, probe=probe,
                            rounding=_AwqRounding(acts, rounding, stacked=stacked, cross_fit=cross_fit, **gram),
                            notes=notes, clock=clock)
    shutil.rmtree(work / _PROGRESS, ignore_errors=True)
    result["rounding"] = rounding
    result["activations"] = acts.summary(gram["max_input_tokens"])
    return result


def write_calibration(out: Path, result: dict, *, source: dict | None = None, cost: dict | None = None) -> dict | None:
    """calib.json (deterministic bytes), the measured ``cost`` (``cost_record``) as calib.cost.json tied to
    calib.json by its sha256, and the manifest that ``verify`` checks, into ``out``; returns the cost
    record as written. A result holding a NaN or infinite number is refused (nothing is written)."""
    bad = non_finite_path(result)
    if bad:
        raise InputError(f"the calibration came out non-finite at {bad} (NaN or infinite); nothing was written",
                         hint="check the model's weights and the calibration text")

    dump_json(result, out / "calib.json")
    if cost is not None:
        cost = {**cost, "calib_sha256": sha256_file(out / "calib.json")}
        dump_json(cost, out / COST_FILE)
    write_manifest(out, kind="calibration", file_hashes={}, source=source, model=result.get("model"),
                   data=result.get("data"))
    return cost


def _identity(p: str | Path) -> str:
    """A path as an absolute, resolved path when it exists (a hub id or other name as given)."""
    q = Path(p)
    return str(q.resolve()) if q.exists() else str(p)


_PROGRESS = "sensitivity-progress"  # resumable per-batch / per-layer state inside the partial directory


class _AwqRounding:
    """The rounding fisher_measure quantizes with: awq.quantize from the routed-token statistics it
    collects per layer into ``acts`` (saved in the artifact), or plain RTN."""

    def __init__(self, acts: "awq.ActivationStats", rounding: str, max_gram_in: int = awq.MAX_GRAM_IN,
                 max_input_tokens: int = awq.MAX_INPUT_TOKENS, stacked: bool = False, cross_fit: bool = True):
        self.acts, self.name, self.stacked, self.cross_fit = acts, rounding, stacked, cross_fit
        self.gram = {"max_gram_in": max_gram_in, "max_input_tokens": max_input_tokens}
        self._stacked: "awq.CheckpointRounding | None" = None
        # Where quantize finds (or keeps) the INT4 searches' pre-quant scale, clip and error-feedback
        # choice: this rounding's own store; a fold's is the whole calibration's (``fold``).
        self.recipes = acts.recipes
        self.input_amax: dict[int, dict[str, torch.Tensor]] = {}  # what static input scales are made from

    def add_layer(self, layer, base, x_all, routed) -> None:
        self.input_amax[layer] = layer_input_amax(base, x_all, routed)
        self.acts.add_layer(layer, awq.collect_layer(base.fc, base.proj, x_all, routed, layer=layer,
                                                     gram=self.name in awq.ERROR_FEEDBACK, **self.gram,
                                                     fc_bias=getattr(base, "fc_bias", None),
                                                     activation=getattr(base, "activation", None)))

    def layer_state(self, layer):
        """The layer's statistics and searched recipes as plain data (resumable progress); the recipes
        are written to the artifact's ``recipes/`` now, so memory holds one layer's."""
        state = awq.layer_state({(e, m): s for (l, e, m), s in self.acts.stats.items() if l == layer})
        recipes = self.acts.recipes.layer_state(layer)
        self.acts.recipes.flush(layer)
        state = {**state, "recipes": recipes} if recipes else state
        return {**state, "input_amax": self.input_amax[layer]} if layer in self.input_amax else state

    def restore_layer(self, layer, state) -> None:
        if state:
            state = dict(state)
            amax = state.pop("input_amax", None)
            if amax is not None:
                if not (isinstance(amax, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                       for k, v in amax.items())):
                    raise InputError("saved input amax is malformed")
                self.input_amax[layer] = amax
            recipes = state.get("recipes")
            if recipes is not None and not isinstance(recipes, dict):
                raise InputError("saved recipes are malformed")
            stats = awq.layer_from_state(state)
            self.acts.recipes.restore(layer, recipes)
            self.acts.add_layer(layer, stats)

    def quantize(self, fmt, w, layer, expert, mod, dtype):
        return awq.quantize(fmt, w, dtype=dtype, stats=self.acts.get(layer, expert, mod), rounding=self.name,
                            keep=(self.recipes, layer, expert, mod),
                            input_amax=(self.input_amax.get(layer) or {}).get(mod))

    def fits_rows(self, fmt) -> bool:
        """Whether this rounding of ``fmt`` is fitted to the calibration rows (scored cross-fitted)."""
        return self.name != "rtn" and (awq.applies(fmt) or fp_gptq.applies(fmt))

    def keeps_recipe(self, fmt) -> bool:
        """Whether quantizing ``fmt`` stores a searched recipe that convert reads back."""
        return self.name != "rtn" and awq.applies(fmt)

    def fold(self, layer, base, x_all, routed) -> "_AwqRounding | None":
        """This rounding fitted on some of the layer's tokens only (``x_all``, ``routed``), for
        cross-fitted scoring: its own statistics, nothing written to the artifact. What it refits is
        what overfits: the codes (error feedback on the fold's Gram matrix) and the float formats'
        block-scale searches. The INT4 formats' searched pre-quant scale, clip and error-feedback
        choice (a few values per channel) are the whole calibration's, read from its recipe store,
        where ``quantize`` has just put them, rather than searched again per fold; the static input
        scales stay the whole calibration's, as the export makes them."""
        if self.name == "rtn" or not self.cross_fit:
            return None
        sub = _AwqRounding(awq.ActivationStats(max_rows=self.acts.max_rows), self.name, **self.gram)
        sub.add_layer(layer, base, x_all, routed)
        sub.input_amax[layer] = self.input_amax[layer]
        sub.recipes = self.acts.recipes
        return sub

    def shares_prequant(self, fmt) -> bool:
        """Whether ``fmt`` is also scored as TensorRT-LLM's stacked layout writes it (``quantize_stacked``)."""
        return self.stacked and awq.shares_prequant(fmt, self.name)

    def quantize_stacked(self, fmt, base, layer, expert, mod, dtype):
        """``quantize`` as TensorRT-LLM's stacked layout writes the matrix: through the checkpoint
        writer's own rounding (``awq.CheckpointRounding``, as at tp=1), whose pre-quant scale is
        searched once on every expert of the layer."""
        w, rec = self._stacked_recipe(fmt, base, layer, expert, mod, dtype)
        return awq.apply(fmt, w, dtype, rec)

    def _stacked_recipe(self, fmt, base, layer, expert, mod, dtype):
        if self._stacked is None or self._stacked.dtype != dtype:
            self._stacked = awq.CheckpointRounding(self.acts, dtype, rounding=self.name)
        mat = lambda e, m: base.fc[e] if m == "fc" else base.proj[e]  # noqa: E731
        w = mat(expert, mod)
        return w, self._stacked.recipe(fmt, layer, expert, mod, (0, base.proj.shape[-1]), w, lambda e: mat(e, mod),
                                       list(range(base.fc.shape[0])), matrix=mat)

    def quantize_stacked_folds(self, fmt, base, layer, expert, mod, dtype, folds):
        """``quantize_stacked`` cross-fitted, one packed matrix per rounding of ``folds``: the layer's
        shared pre-quant scale and the clip as the whole calibration searched them, the error-feedback
        codes chosen again on each fold's statistics; None when the whole calibration's recipe has no
        codes (nothing fitted per row but the scale and clip: scored as it is)."""
        w, rec = self._stacked_recipe(fmt, base, layer, expert, mod, dtype)
        if rec is None or rec.codes is None:
            return None
        on = awq.Recipe(rec.pq, rec.base_clip)  # what the codes were chosen on
        return tuple(awq.apply(fmt, w, dtype, awq.with_codes(fmt, w, dtype, r.acts.get(layer, expert, mod), on,
                                                                 choice=0)) for r in folds)


def _adopt_progress(parent: Path, name: str, notes: list[str] | None = None) -> Path | None:
    """Move the sensitivity progress out of a dead run's partial directory for the same output (before
    that directory is cleaned up) into a sibling marked with this process's pid; None if there is none.
    Progress is adopted only from a real directory of this user's holding this user's progress marker
    and nothing but plain directories and files of this user's; anything else is removed (a link
    unlinked, never followed) and the run starts over, with a note saying why."""
    prefix = f".{name}{_MARK}"
    if not parent.is_dir():
        return None
    for p in sorted(parent.glob(prefix + "*")):
        pid, _, rest = p.name[len(prefix):].partition("-")
        if not pid.isdigit() or rest.startswith("old-") or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        if not own_directory(p) or not os.path.lexists(p / _PROGRESS):
            continue
        dest = parent / f"{prefix}{os.getpid()}-resume-{uuid.uuid4().hex[:8]}"
        os.rename(p / _PROGRESS, dest)  # moves a link itself, never what it points to
        why = foreign_entry(dest)
        if why is None and owned_marker(dest) is None:
            why = f"it has no valid {Progress.MARKER} of this user's"
        if why is None:
            return dest
        remove_tree(dest, parent)
        if notes is not None:
            notes.append(f"an interrupted run's progress was not resumed ({why}); starting over")
    return None


@contextlib.contextmanager
def _resumable(tmp: Path, parent: Path, name: str, adopted: Path | None):
    """Put adopted progress into ``tmp``; if the run is interrupted (Ctrl-C, SIGTERM), move the
    progress out to a pid-marked sibling that the next run to the same output adopts."""
    if adopted is not None:
        os.rename(adopted, tmp / _PROGRESS)
    try:
        yield tmp
    except BaseException as e:
        if not isinstance(e, Exception) and (tmp / _PROGRESS / Progress.MARKER).is_file():
            keep = parent / f".{name}{_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            keep.mkdir()
            os.rename(tmp / _PROGRESS, keep / _PROGRESS)
        raise


@contextlib.contextmanager
def _workspace(out_dir, force: bool, inputs=(), notes: list[str] | None = None):
    """The directory a calibration works in: the output's atomic partial sibling, or without an
    output a pid-marked directory in the system temp dir. Either way a killed run's directory carries
    its pid, and the next run (to the same output, or any output-less run) removes it, after taking
    over its sensitivity progress (which the measurement reuses only for the same inputs)."""
    if out_dir is not None:
        out = Path(out_dir).expanduser().absolute()
        adopted = _adopt_progress(out.parent, out.name, notes)
        try:
            with atomic_directory(out_dir, force=force, inputs=inputs) as tmp, \
                    _resumable(tmp, out.parent, out.name, adopted) as w:
                yield w
        finally:
            if adopted is not None:
                remove_tree(adopted, out.parent)
        return
    parent, name = Path(tempfile.gettempdir()), "trtmoe-calib"
    adopted = _adopt_progress(parent, name, notes)
    recover_leftovers(parent / name)
    tmp = parent / f".{name}{_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with _resumable(tmp, parent, name, adopted) as w:
            yield w
    finally:
        remove_tree(tmp, parent)
        if adopted is not None:
            remove_tree(adopted, parent)


def applicable_formats(formats, hidden: int, inter: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """The formats that can store an expert (fc [2I, H], proj [H, I]), and why each other one cannot."""
    usable, skipped = [], {}
    for f in formats:
        problem = expert_shape_problem(f, hidden, inter)
        if problem:
            skipped[f] = problem
        else:
            usable.append(f)
    return tuple(usable), skipped


def _special_tokens(tok, tok_dir: Path, add_bos: bool | None) -> dict:
    """Which BOS/EOS calibration uses and where the BOS choice came from: an explicit override, the
    tokenizer_config.json's add_bos_token, or, lacking that, BOS whenever the tokenizer's files name
    one (a Llama-style tokenizer prepends it unless told otherwise)."""
    conf_file = tok_dir / "tokenizer_config.json"
    conf = {}
    if conf_file.is_file():
        try:
            conf = json.loads(conf_file.read_text())
        except (OSError, json.JSONDecodeError):
            conf = {}
    bos = tok.bos_id
    if add_bos is not None:
        use, origin = bool(add_bos), "--add-bos" if add_bos else "--no-add-bos"
    elif isinstance(conf, dict) and "add_bos_token" in conf:
        use, origin = bool(conf["add_bos_token"]), "tokenizer_config.json add_bos_token"
    else:
        use, origin = bos is not None, "no add_bos_token in the tokenizer's files: BOS prepended when it has one"
    if use and bos is None:
        if add_bos:
            raise InputError("--add-bos: the tokenizer names no BOS token", where=str(tok_dir))
        use = False
    name = lambda i: "none" if i is None else f"{tok.tok.id_to_token(i)!r} (id {i})"  # noqa: E731
    note = (f"calibration text: BOS {name(bos) if use else 'not prepended'}"
            f"{'' if use or bos is None else f' (tokenizer has {name(bos)})'}, EOS {name(tok.eos_id)} between "
            f"documents ({origin})")
    return {"bos_id": bos if use else None, "eos_id": tok.eos_id, "add_bos": use, "add_bos_from": origin,
            "note": note}


@torch.inference_mode()
def measure(eng: EmbeddedEngine, ids: torch.Tensor, *, formats=DEFAULT_FORMATS, min_tokens: int = 16,
            batch_size: int = 8, progress=None, rounding: str = awq.DEFAULT_ROUNDING,
            activations: "awq.ActivationStats | None" = None, max_gram_in: int = awq.MAX_GRAM_IN,
            max_input_tokens: int = awq.MAX_INPUT_TOKENS, clock: PhaseClock | None = None) -> dict:
    """Routing statistics and sensitivities with a loaded engine (tp=1 float checkpoint).

    Returns the calib.json dict (``version`` = CALIB_VERSION). ΔKL values are mean KL per calibration
    token, in nats: ``sensitivity.matrices[m].delta_kl[f][l][e]`` per matrix m ∈ {fc, proj}, and
    ``sensitivity.delta_kl[f][l][e]`` = fc + proj per expert. The int4 formats are quantized with
    ``rounding`` (awq: from each matrix's routed-token statistics, gathered into ``activations``;
    ``max_gram_in`` and ``max_input_tokens``: see ``calibrate``). ``clock`` receives the seconds of the
    reference pass ("forward") and of the per-matrix measurement ("scoring", searches and statistics
    included)."""
    if rounding not in awq.ROUNDINGS:
        raise InputError(f"unknown rounding {rounding!r}", hint=awq.ROUNDING_HINT)
    acts = activations if activations is not None else awq.ActivationStats()
    c = eng.cfg
    moe_layers = [l for l in range(c.num_layers) if c.moe_layers[l]]
    check_float_banks(eng, moe_layers)
    clock = clock if clock is not None else PhaseClock()  # nobody reads it: no device synchronisation
    with clock("forward"):
        ref = _reference_pass(eng, ids, moe_layers, batch_size)
    with clock("scoring"):
        exact = _exact_delta_kl(eng, ref, moe_layers, formats, rounding, acts, batch_size, progress,
                                {"max_gram_in": max_gram_in, "max_input_tokens": max_input_tokens})
    eng.reset_routing_stats()  # the measurement passes are not calibration statistics
    filled = _fill_under_observed(exact, ref, moe_layers, formats, min_tokens, c.num_experts, c.top_k)
    return _exact_result(eng, ref, exact, filled, moe_layers, formats, rounding, acts, min_tokens,
                         max_input_tokens)


@dataclass
class _Reference:
    """The reference pass over the calibration set: log-probs, the residual stream entering every MoE
    layer, each MoE layer's inputs and routed experts, and the routing statistics."""

    logp: torch.Tensor  # [N, T, V]
    resid: dict[int, torch.Tensor]  # MoE layer -> [N, T, H]
    moe_in: dict[int, list[torch.Tensor]]  # MoE layer -> per-batch inputs [tokens, H]
    routed: dict[int, torch.Tensor]  # MoE layer -> [N, T, k]
    stats: dict
    tokens: int
    share: torch.Tensor  # [L, E] fraction of top-k assignments per expert


def _reference_pass(eng: EmbeddedEngine, ids: torch.Tensor, moe_layers: list[int], batch_size: int) -> _Reference:
    """1. Reference pass: log-probs, the residual stream entering every layer, the MoE layer inputs."""
    c = eng.cfg
    L, k = c.num_layers, c.top_k
    eng.reset_routing_stats()
    ref_logp, resid, moe_in = [], {l: [] for l in range(L)}, {l: [] for l in moe_layers}
    routes: dict[int, list[torch.Tensor]] = {l: [] for l in moe_layers}
    eng.residual_hook = lambda li, x: resid[li].append(x.clone())
    eng.layer_hook = lambda li, h: moe_in[li].append(h.clone())
    eng.route_hook = lambda li, idx: routes[li].append(idx.clone())
    try:
        for b in ids.split(batch_size):
            ref_logp.append(eng.logits(b).log_softmax(-1))
    finally:
        eng.residual_hook = eng.layer_hook = eng.route_hook = None
    N, T = ids.shape
    stats = eng.routing_stats()
    tokens = ids.numel()
    return _Reference(
        logp=torch.cat(ref_logp), resid={l: torch.cat(resid[l]) for l in moe_layers}, moe_in=moe_in,
        routed={l: torch.cat(routes[l]).reshape(N, T, k) for l in moe_layers}, stats=stats, tokens=tokens,
        share=stats["counts"].double() / (tokens * k))


@dataclass
class _Exact:
    """End-to-end ΔKL and all-token output error per matrix, format, layer and expert, and the cost."""

    measured: dict[str, dict[str, torch.Tensor]]
    out_err: dict[str, dict[str, torch.Tensor]]
    passes: float
    input_amax: dict[int, dict[str, torch.Tensor]]


def _zeros(formats, L: int, E: int) -> dict[str, torch.Tensor]:
    return {f: torch.zeros(L, E, dtype=torch.float64) for f in formats}


def _exact_delta_kl(eng: EmbeddedEngine, ref: _Reference, moe_layers: list[int], formats, rounding: str,
                    acts: "awq.ActivationStats", batch_size: int, progress, gram: dict | None = None) -> _Exact:
    """2. Sensitivity: end-to-end ΔKL per (layer, expert, matrix, format). Fills ``acts`` with each MoE
    layer's routed-token statistics (what the int4 formats are rounded from)."""
    c = eng.cfg
    L, E, k = c.num_layers, c.num_experts, c.top_k
    N = ref.logp.shape[0]
    total = len(moe_layers) * E * len(formats) * len(MATRICES)
    done = 0
    measured = {m: _zeros(formats, L, E) for m in MATRICES}
    out_err = {m: _zeros(formats, L, E) for m in MATRICES}
    in_amax: dict[int, dict[str, torch.Tensor]] = {}
    passes = 0.0
    for l in moe_layers:
        lay = eng.layers[l]
        base = lay.experts
        x_all = torch.cat(ref.moe_in[l])  # [tokens, H]: every calibration token's input to this layer
        in_amax[l] = layer_input_amax(base, x_all, ref.routed[l].reshape(-1, k))
        acts.add_layer(l, awq.collect_layer(base.fc, base.proj, x_all, ref.routed[l].reshape(-1, k), layer=l,
                                            gram=rounding in awq.ERROR_FEEDBACK, **(gram or {})))
        frac = (L - l) / L
        for e in range(E):
            y_ref = base.forward(e, x_all)
            # Only sequences with a token routed to e can change (the rest reproduce the reference
            # exactly), so only those are rerun.
            seqs = ref.routed[l].eq(e).any(-1).any(-1).nonzero().flatten()
            ws = base.row_major(e)
            for f in formats:
                fmt = format_obj(f, eng.dtype)
                for m in MATRICES:
                    w = ws[m]
                    packed = awq.quantize(fmt, w, dtype=eng.dtype, stats=acts.get(l, e, m), rounding=rounding,
                                          keep=(acts.recipes, l, e, m), input_amax=in_amax[l][m])
                    swapped = _MatrixSwapped(base, e, **{m: (fmt, packed)})
                    # Output error over all tokens, routing ignored (for seldom-routed experts).
                    y_q = swapped.forward(e, x_all)
                    out_err[m][f][l, e] = float((y_q - y_ref).float().pow(2).sum(-1).mean())
                    if len(seqs):
                        lay.experts = swapped
                        try:
                            kl = sum(float(kl_per_token(ref.logp[chunk], eng.logits_from(l, ref.resid[l][chunk])).sum())
                                     for chunk in seqs.split(batch_size))
                        finally:
                            lay.experts = base
                        measured[m][f][l, e] = kl / ref.tokens
                        passes += frac * len(seqs) / N
                    done += 1
                    if progress:
                        progress("sensitivity", done, total)
    return _Exact(measured, out_err, passes, in_amax)


def _fill_under_observed(exact: _Exact, ref: _Reference, moe_layers: list[int], formats, min_tokens: int,
                         E: int, k: int) -> dict:
    """3. Seldom-routed experts: estimate from all-token output error, fitted per layer, format, matrix.
    Returns the sensitivities (the larger of measured and estimated where under-observed), the
    estimates, the flagged experts and the floor share."""
    counts, share = ref.stats["counts"], ref.share
    measured, out_err = exact.measured, exact.out_err
    L = counts.shape[0]
    floor = 0.25 * k / E  # a share we assume an under-observed expert could see on other text
    sens = {m: {f: measured[m][f].clone() for f in formats} for m in MATRICES}
    estimated = {m: _zeros(formats, L, E) for m in MATRICES}
    flagged = []
    for l in moe_layers:
        covered = [e for e in range(E) if counts[l, e] >= min_tokens]
        for m in MATRICES:
            for f in formats:
                num = sum(float(measured[m][f][l, e]) for e in covered)
                den = sum(float(out_err[m][f][l, e] * share[l, e]) for e in covered)
                coef = num / den if den > 0 else 0.0
                for e in range(E):
                    estimated[m][f][l, e] = coef * float(out_err[m][f][l, e]) * max(float(share[l, e]), floor)
                    if counts[l, e] < min_tokens:
                        sens[m][f][l, e] = max(float(measured[m][f][l, e]), float(estimated[m][f][l, e]))
        flagged += [{"layer": l, "expert": e, "tokens": int(counts[l, e])} for e in range(E)
                    if counts[l, e] < min_tokens]
    return {"sens": sens, "estimated": estimated, "flagged": flagged, "floor": floor}


def _exact_result(eng: EmbeddedEngine, ref: _Reference, exact: _Exact, filled: dict, moe_layers: list[int],
                  formats, rounding: str, acts: "awq.ActivationStats", min_tokens: int,
                  max_input_tokens: int = awq.MAX_INPUT_TOKENS) -> dict:
    """The calib.json dict of an exact measurement."""
    c = eng.cfg
    L, E, k = c.num_layers, c.num_experts, c.top_k
    stats, tokens = ref.stats, ref.tokens
    counts, mass = stats["counts"], stats["weight_mass"]
    sens, estimated = filled["sens"], filled["estimated"]
    entropy = [float(stats["entropy_sum"][l]) / tokens for l in range(L)]
    layer_load = counts.double()
    imbalance = [float(layer_load[l].max() / layer_load[l].mean()) if layer_load[l].sum() > 0 else 0.0
                 for l in range(L)]
    I, H = c.expert_intermediate_size, c.hidden_size
    expert_weights = 3 * I * H
    as_lists = lambda d: {f: t.tolist() for f, t in d.items()}  # noqa: E731
    return {
        "version": CALIB_VERSION,
        "architecture": c.family,
        "num_layers": L, "num_experts": E, "top_k": k, "moe_layers": moe_layers,
        "hidden_size": H, "expert_intermediate_size": I, "dtype": str(eng.dtype).replace("torch.", ""),
        "weights_per_expert": expert_weights,
        "formats": list(formats),
        "rounding": rounding,
        "input_amax": amax_json(exact.input_amax),
        "activations": acts.summary(max_input_tokens),
        "bits_per_weight": {f: _expert_bpw(f, I, H, eng.dtype) for f in (FLOAT, *formats)},
        "routing": {
            "tokens": tokens,
            "counts": counts.tolist(),
            "share": ref.share.tolist(),
            "weight_mass": mass.tolist(),
            "entropy_nats": entropy,
            "max_entropy_nats": math.log(E),
            "load_imbalance": imbalance,
            "min_tokens_threshold": min_tokens,
            "under_observed": filled["flagged"],
            "dead": [{"layer": l, "expert": e} for l in moe_layers for e in range(E) if counts[l, e] == 0],
        },
        "sensitivity": {
            "metric": "mean KL(p_ref || p_quant) per calibration token, nats",
            # Per expert: the sum of its two matrices' ΔKL (see the module docstring).
            "delta_kl": {f: (sens["fc"][f] + sens["proj"][f]).tolist() for f in formats},
            "expert_delta_kl": "fc + proj",
            "matrices": {m: {"delta_kl": as_lists(sens[m]), "measured": as_lists(exact.measured[m]),
                             "estimated": as_lists(estimated[m]), "output_mse": as_lists(exact.out_err[m])}
                         for m in MATRICES},
            "floor_share": filled["floor"],
            # Full forward passes over the calibration set that the measurement cost (the reference
            # pass not included); each per-matrix pass reruns layers l..L-1 only.
            "cost_forward_passes": exact.passes,
        },
    }


def load_calib(path: str | Path) -> dict:
    """Read ``calib.json`` (a file or the directory holding it); InputError when it is missing, not
    JSON, or of another layout version (an older one needs recalibrating)."""
    p = Path(path)
    f = p / "calib.json" if p.is_dir() else p
    if not f.is_file():
        raise InputError("no calib.json", where=str(p), hint="run `trtmoe calibrate` first")
    try:
        calib = parse_calib_json(f.read_bytes().decode("utf-8"))
    except NonFinite as e:
        raise InputError(f"calib.json {e}", where=str(f),
                         hint="recalibrate: trtmoe calibrate MODEL --data TEXT -o DIR") from None
    except UnicodeDecodeError as e:
        raise InputError(f"calib.json is not UTF-8 text (byte {e.start})", where=str(f)) from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise InputError(f"calib.json is not valid JSON ({e})", where=str(f)) from None
    if not isinstance(calib, dict):
        raise InputError("calib.json does not hold a calibration object", where=str(f))
    return check_calib(calib, str(f))
