"""Per-matrix sensitivity from one forward and one backward pass: a Fisher (second-order) estimate of
the end-to-end ΔKL whose cost does not grow with the number of experts (``--sensitivity fisher``, the
default; ``--sensitivity exact`` reruns the model per expert matrix and format, see calibrate.py).

The estimator. Let z_s be the logits at calibration position s and p_s = softmax(z_s) the reference
distribution. Quantizing one matrix of expert e in MoE layer l changes that layer's output, for each
token t routed to e, by δ_t = w_te·Δy_t (w_te the routing weight, Δy_t the expert's output change on
that token's input); every other token's output is unchanged. KL(p_s ‖ p_s') is zero with zero
gradient at δ = 0, so to second order

    Σ_s KL_s ≈ ½ δᵀ F δ,   F = Σ_s J_sᵀ (diag p_s − p_s p_sᵀ) J_s,   J_s = ∂z_s/∂δ,

F being the Fisher information of the reference's own output distributions with respect to the layer
output (for a softmax output it equals the Gauss-Newton matrix of the KL). F is never formed: with a
random probe v_s per position that has E[v_s v_sᵀ] = diag p_s − p_s p_sᵀ, independent across
positions, the vector-Jacobian product g = Σ_s J_sᵀ v_s (one backward pass of Σ_s v_s·z_s) satisfies
E[g gᵀ] = F, so ½ E[(g·δ)²] = ½ δᵀ F δ. Two probes are available: ``gaussian`` (the default),
v = √p ⊙ u − p (√p·u) with u ~ N(0, I), whose (g·δ)² is the exact quadratic form times a χ²₁ (relative
variance 2 whatever p looks like), and ``sample``, v = onehot(y) − p with y drawn from p_s (the
gradient of log p_s(y), the classic Fisher probe; heavier-tailed when p_s is peaked).

One backward pass gives g_t (the gradient at layer l's output for token t) for every layer and token
at once. The quadratic form is then split by token, dropping the cross-token terms of F:

    ΔKL_e ≈ 1/(N·T) · ½ Σ_{t routed to e} (g_t · w_te Δy_t)²

(the ``token`` estimate). A quantization error at token t reaches later positions only through
attention, and the cross-token terms' sign varies with the probe, so they add mostly noise for the
number of tokens calibration has; the per-sequence form ½ Σ_seq (Σ_{t∈seq} g_t·w_te Δy_t)², unbiased
for the full quadratic form, is recorded alongside (``sequence_delta_kl``) for comparison. Δy_t is
computed exactly (not linearized) through the format's own packed ``linear``: for fc,
g_t·Δy_t = (projᵀ g_t)·(a_q − a) with a = silu(gate)·up, for proj g_t·(proj_q(a) − proj(a)).

Experts routed fewer than ``min_tokens`` calibration tokens are also estimated on evenly spaced tokens
of the layer (routing ignored, the layer's mean routing weight; at most ``ESTIMATE_TOKENS`` per expert
and 1/``ESTIMATE_SHARE`` of the layer's routed assignments in all), scaled by a floor routing share, as
the exact method does; the larger value is kept. The estimate is a floor for experts whose own tokens
are too few to rank, so a few dozen tokens suffice for it.

Model work, counted in forward-pass equivalents (multiply-accumulates of the reference forward over the
calibration set; calib.json's ``cost_forward_passes``): 1 forward, 1 backward (activation gradients only: the same matmuls once more, plus
attention's second pair), and per routed token-assignment one expert pass once (fc, and projᵀg, which
also gives the reference term g·proj(a) = (projᵀg)·a) plus one expert pass per candidate format (fc_q:
2IH, proj_q: IH): about 2 + φ·(1 + F) with φ the routed experts' share of the forward's
multiply-accumulates — independent of the number of experts. No full-vocabulary tensor outlives its
batch. That count leaves the quantization searches out; what a calibration really takes is measured
per phase (``PhaseClock``) and written apart from calib.json (calibrate.py's ``cost_record``).

Streaming and resumption: phase 1 runs the batches (forward + backward) and writes each MoE layer's
inputs, routing and output gradients per batch into ``work/acts`` (activation dtype); phase 2 scores
one layer at a time from those files (one layer's activations in memory), writes
``work/layers/layer-L.safetensors`` and deletes the layer's activations. A rerun with the same ``key``
skips every batch and layer already on disk, so an interrupted calibration continues where it stopped.
Every progress file is data only (``hf.tree_file``: tensors and JSON, never unpickled), checked when
read back (structure, shapes, finite values); progress is reused only under this user's marker
(``Progress.MARKER``) with the same key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..hf.tree_file import read_tree, write_tree
from ..runtime.engine import EmbeddedEngine
from ..runtime.experts import FloatExperts
from .calib_schema import build_result
from .plan import MATRICES, format_obj

PROBES = ("gaussian", "sample")
SENSITIVITY_METHODS = ("fisher", "exact")
DEFAULT_SENSITIVITY = "fisher"
ESTIMATE_TOKENS = 64  # layer tokens an under-observed expert's estimate is computed on
ESTIMATE_SHARE = 16  # under-observed experts' estimates together score at most 1/16 of the routed tokens
# Scoring key of a format as TensorRT-LLM's stacked layout rounds it (one pre-quant scale per MoE layer
# and matrix kind, ``awq.shares_prequant``); calib.json keeps those ΔKL under sensitivity.stacked.
STACKED = "@stacked"


@torch.inference_mode()
def layer_input_amax(bank: FloatExperts, x_all: torch.Tensor, routed: torch.Tensor,
                     amax: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Per input channel, the absolute maximum of each matrix kind's inputs over one MoE layer's
    calibration tokens, shared by all the layer's experts (a fused-MoE kernel takes one static input
    scale per layer and matrix kind): ``fc`` sees the layer input of every token routed to any expert,
    ``proj`` the activations ``silu(gate) * up`` of each expert over its own routed tokens. ``x_all``
    [tokens, H], ``routed`` [tokens, k] expert ids; with ``amax`` (a previous batch's result) the
    maxima accumulate. The formats with a static input scale take these as ``input_amax``."""
    x = x_all[(routed >= 0).any(-1)]
    fc = x.abs().amax(0).float() if len(x) else x_all.new_zeros(x_all.shape[-1], dtype=torch.float32)
    proj = None
    for e in range(bank.fc.shape[0]):
        rows = (routed == e).any(-1)
        if not bool(rows.any()):
            continue
        a = expert_activation(bank, bank.fc_out(e, x_all[rows])).abs().amax(0).float()
        proj = a if proj is None else torch.maximum(proj, a)
    if proj is None:
        proj = torch.zeros(bank.proj.shape[-1], dtype=torch.float32)
    if amax is not None:
        fc, proj = torch.maximum(fc, amax["fc"]), torch.maximum(proj, amax["proj"])
    return {"fc": fc, "proj": proj}


def amax_json(amax: dict[int, dict[str, torch.Tensor]]) -> dict[str, dict[str, list[float]]]:
    """``layer_input_amax`` results per MoE layer as calib.json stores them (``input_amax``)."""
    return {str(l): {m: [float(v) for v in t.tolist()] for m, t in d.items()} for l, d in sorted(amax.items())}


class RTN:
    """Round-to-nearest: each matrix quantized from its weights alone (``fmt.quantize``), the static
    input scales from the layer's input amax."""

    name = "rtn"

    def __init__(self):
        self.input_amax: dict[int, dict[str, torch.Tensor]] = {}

    def add_layer(self, layer: int, base: FloatExperts, x_all: torch.Tensor, routed: torch.Tensor) -> None:
        self.input_amax[layer] = layer_input_amax(base, x_all, routed)

    def quantize(self, fmt, w: torch.Tensor, layer: int, expert: int, mod: str, dtype: torch.dtype) -> dict:
        return fmt.quantize(w, dtype=dtype, input_amax=(self.input_amax.get(layer) or {}).get(mod))

    def layer_state(self, layer: int):
        return {"input_amax": self.input_amax[layer]} if layer in self.input_amax else None

    def restore_layer(self, layer: int, state) -> None:
        if state and "input_amax" in state:
            self.input_amax[layer] = state["input_amax"]


class PhaseClock:
    """Measured seconds per phase of a calibration: wall time and this process's CPU time (every thread),
    on CUDA device-synchronised at each phase boundary. Phases nest: time spent in an inner phase is
    counted there only, so the phases add up to the whole."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.resumed = False  # set by a runner that continued an interrupted run's progress
        self._stack: list[list] = []  # [phase, wall at (re)start, cpu at (re)start]

    def _now(self) -> tuple[float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter(), time.process_time()

    def _add(self, phase: str, wall: float, cpu: float) -> None:
        self.wall[phase] = self.wall.get(phase, 0.0) + wall
        self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu

    @contextlib.contextmanager
    def __call__(self, phase: str):
        w, c = self._now()
        if self._stack:  # the enclosing phase pauses
            outer = self._stack[-1]
            self._add(outer[0], w - outer[1], c - outer[2])
        self._stack.append([phase, w, c])
        try:
            yield
        finally:
            w, c = self._now()
            _, w0, c0 = self._stack.pop()
            self._add(phase, w - w0, c - c0)
            if self._stack:
                self._stack[-1][1:] = [w, c]

    def phases(self) -> dict[str, dict[str, float]]:
        """Per phase, in the order first entered: {"wall_seconds": s, "cpu_seconds": s}."""
        return {k: {"wall_seconds": self.wall[k], "cpu_seconds": self.cpu[k]} for k in self.wall}

    def timed(self, rounding):
        """``rounding`` (see ``RTN``) with its statistics collection and its quantization (the AWQ / GPTQ
        searches included) timed as the phases "statistics" and "searches"."""
        return _TimedRounding(rounding, self)


class _TimedRounding:
    """A rounding whose ``add_layer`` and ``quantize`` calls are timed; everything else is the rounding's."""

    def __init__(self, inner, clock: PhaseClock):
        self._inner, self._clock = inner, clock

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def add_layer(self, *args, **kwargs):
        with self._clock("statistics"):
            return self._inner.add_layer(*args, **kwargs)

    def quantize(self, *args, **kwargs):
        with self._clock("searches"):
            return self._inner.quantize(*args, **kwargs)

    def quantize_stacked(self, *args, **kwargs):
        with self._clock("searches"):
            return self._inner.quantize_stacked(*args, **kwargs)

    def quantize_stacked_folds(self, *args, **kwargs):
        with self._clock("searches"):
            return self._inner.quantize_stacked_folds(*args, **kwargs)

    def fold(self, *args, **kwargs):
        fold = getattr(self._inner, "fold", None)
        if fold is None:
            return None
        with self._clock("statistics"):
            got = fold(*args, **kwargs)
        return None if got is None else _TimedRounding(got, self._clock)

    def layer_state(self, layer):
        with self._clock("io"):  # the layer's searched recipes are written out here
            return self._inner.layer_state(layer)


def forward_macs(cfg, seq_len: int) -> dict:
    """Multiply-accumulates per token of one causal forward over ``seq_len``-token windows: total,
    routed experts, attention scores (QKᵀ and PV)."""
    H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    I, k, E = cfg.expert_intermediate_size, cfg.top_k, cfg.num_experts
    ctx = (seq_len + 1) / 2  # mean keys attended per query under a causal mask
    total = experts = scores = 0.0
    for l in range(cfg.num_layers):
        total += H * (nh + 2 * nkv) * hd + nh * hd * H
        s = 2 * nh * hd * ctx
        scores += s
        total += s
        if cfg.moe_layers[l]:
            total += H * E + k * 3 * I * H
            experts += k * 3 * I * H
            S = cfg.shared_expert_intermediate_size
            if S:
                total += 3 * S * H + (H if cfg.shared_expert_gate else 0)
        else:
            total += 3 * cfg.dense_intermediate_size * H
    total += H * cfg.vocab_size
    return {"total": total, "experts": experts, "attention_scores": scores}


def _probe(logits: torch.Tensor, kind: str, gen: torch.Generator, chunk: int = 1024) -> torch.Tensor:
    """v with E[v vᵀ] = diag p − p pᵀ per position (p = softmax(logits)), float32, detached; built
    ``chunk`` positions at a time so that only one full-vocabulary copy (v itself) is added."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    v = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    for i in range(0, flat.shape[0], chunk):
        p = flat[i:i + chunk].float().softmax(-1)
        if kind == "gaussian":
            u = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device)
            u.mul_(p.sqrt())
            v[i:i + chunk] = u - p * u.sum(-1, keepdim=True)
        else:
            y = torch.multinomial(p.cpu(), 1, generator=gen).to(p.device)
            v[i:i + chunk] = p.neg_().scatter_add_(1, y, torch.ones_like(y, dtype=p.dtype))
    return v.reshape(logits.shape)


def _save(obj, path: Path) -> None:
    """Write progress data atomically (a kill leaves the previous file or none, never half of one)."""
    write_tree(path, obj)


def _load(path: Path, check: Callable[[object], None]):
    """Read back one progress file and ``check`` its structure; InputError naming it when it is not
    what this module wrote (data only: a file is parsed, never executed). The progress it belongs to
    is discarded with the run's partial output, so the next run starts over."""
    try:
        obj = read_tree(path)
        check(obj)
        return obj
    except InputError as e:
        why = e.what
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        why = f"malformed ({str(e)[:120]})"
    raise InputError(f"resumed calibration progress is unusable: {why}", where=str(path),
                     hint="its saved progress was discarded; run the command again to start over")


class Progress:
    """The resumable state in ``work``: which batches and layers are done, for which inputs. Files in
    ``work`` are reused only when its marker says this user's run with the same ``key`` wrote them;
    anything else there is removed first (links unlinked, never followed)."""

    MARKER = "trtmoe-progress.json"
    VERSION = 4  # progress written as tree_file safetensors; 3: layer scores cross-fitted; 4: error feedback dampened by rows per input

    def __init__(self, work: Path, key: str):
        self.work = work
        self.acts, self.layers = work / "acts", work / "layers"
        if work.is_symlink():
            raise InputError("the calibration progress directory is a symbolic link", where=str(work))
        digest = hashlib.sha256(key.encode()).hexdigest()
        if owned_marker(work) != digest:  # progress of another calibration, or not ours: start over
            for d in (self.acts, self.layers):
                if d.is_symlink() or d.is_file():
                    d.unlink()
                elif d.is_dir():
                    shutil.rmtree(d)
        self.acts.mkdir(parents=True, exist_ok=True)
        self.layers.mkdir(parents=True, exist_ok=True)
        for d in (self.acts, self.layers):
            if d.is_symlink() or not d.is_dir():
                raise InputError("the calibration progress directory holds a link", where=str(d))
        marker = work / self.MARKER
        tmp = work / (self.MARKER + ".tmp")
        if os.path.lexists(tmp):
            tmp.unlink()
        tmp.write_text(json.dumps({"tool": "trtmoe", "kind": "calibration-progress", "version": self.VERSION,
                                   "uid": os.getuid(), "key_sha256": digest}))
        os.replace(tmp, marker)

    def batch_file(self, b: int) -> Path:
        return self.acts / f"batch-{b:06d}.safetensors"

    def act_file(self, l: int, b: int) -> Path:
        return self.acts / f"layer-{l:03d}-batch-{b:06d}.safetensors"

    def layer_file(self, l: int) -> Path:
        return self.layers / f"layer-{l:03d}.safetensors"


def owned_marker(work: Path) -> str | None:
    """The key hash in ``work``'s progress marker when this user's trtmoe wrote it (a regular file,
    owned by this user, of the current version), else None."""
    marker = work / Progress.MARKER
    try:
        st = os.lstat(marker)
        if not os.path.isfile(marker) or os.path.islink(marker) or st.st_uid != os.getuid():
            return None
        d = json.loads(marker.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(d, dict) or d.get("tool") != "trtmoe" or d.get("kind") != "calibration-progress" \
            or d.get("version") != Progress.VERSION or d.get("uid") != os.getuid():
        return None
    sha = d.get("key_sha256")
    return sha if isinstance(sha, str) else None


def check_float_banks(eng: EmbeddedEngine, moe_layers: list[int]) -> None:
    """Calibration reads every MoE layer's plain float expert weights: refuse an engine without them."""
    for l in moe_layers:
        bank = eng.layers[l].experts
        if not isinstance(bank, FloatExperts):
            raise InputError("calibration needs an unquantized model")
        if bank.packed:
            raise InputError("calibration reads the experts' plain weights, which this engine holds packed "
                             "for oneDNN", hint="load the engine with pack_experts=False")


@torch.no_grad()
def fisher_measure(eng: EmbeddedEngine, ids: torch.Tensor, *, formats, min_tokens: int = 16, batch_size: int = 8,
                   progress: Callable[[str, int, int], None] | None = None, work: Path | None = None,
                   key: str = "", probe: str = "gaussian", seed: int = 0, rounding=None,
                   estimate_tokens: int = ESTIMATE_TOKENS, notes: list[str] | None = None,
                   clock: PhaseClock | None = None) -> dict:
    """Routing statistics and Fisher-estimated ΔKL per (layer, expert, matrix, format), in the layout
    of ``calibrate.measure`` (calib.json). ``work`` holds the resumable progress (a temporary
    directory when None); ``key`` identifies the inputs it belongs to. ``rounding`` quantizes the
    matrices (default round-to-nearest; see ``RTN`` for the interface). What was resumed from
    earlier progress is appended to ``notes``. ``clock`` receives the measured seconds per phase
    (forward, backward, statistics, searches, scoring, io)."""
    if probe not in PROBES:
        raise InputError(f"unknown probe {probe!r}", hint="use " + " or ".join(PROBES))
    clock = clock if clock is not None else PhaseClock()  # nobody reads it: no device synchronisation
    rounding = clock.timed(rounding or RTN())
    c = eng.cfg
    moe_layers = [l for l in range(c.num_layers) if c.moe_layers[l]]
    check_float_banks(eng, moe_layers)
    own_work = work is None
    if own_work:
        work = Path(tempfile.mkdtemp(prefix="trtmoe-fisher-"))
    try:
        result = _run(eng, ids, formats=tuple(formats), min_tokens=min_tokens, batch_size=batch_size,
                    progress=progress, probe=probe,
                    # Layer files scored under other estimate settings are not resumed from.
                    state=Progress(Path(work), f"{key}|estimate {estimate_tokens}/{ESTIMATE_SHARE}"), seed=seed,
                    rounding=rounding, estimate_tokens=estimate_tokens, moe_layers=moe_layers,
                    notes=notes if notes is not None else [], clock=clock)
        # Each MoE layer's input amax per matrix kind, what the static input scales are made from.
        result["input_amax"] = amax_json(getattr(rounding, "input_amax", {}))
        return result
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


def _run(eng, ids, *, formats, min_tokens, batch_size, progress, state: Progress, probe, seed, rounding,
         estimate_tokens, moe_layers, notes, clock: PhaseClock) -> dict:
    c = eng.cfg
    batches = list(ids.split(batch_size))
    tick = _Ticker(progress, len(batches) + len(moe_layers) * c.num_experts)
    resumed = [sum(state.batch_file(b).is_file() for b in range(len(batches))),
               sum(state.layer_file(l).is_file() for l in moe_layers)]
    if any(resumed):
        clock.resumed = True
        notes.append(f"sensitivity resumed from an interrupted run: {resumed[0]} of {len(batches)} batches and "
                     f"{resumed[1]} of {len(moe_layers)} MoE layers were already done")
    _forward_backward(eng, batches, moe_layers, state, probe, seed, tick, clock)
    with clock("io"):
        counts, mass, entropy = _routing_totals(state, len(batches), c.num_layers, c.num_experts)
    N, T = ids.shape
    shares = getattr(rounding, "shares_prequant", lambda fmt: False)
    keys = tuple(formats) + tuple(f + STACKED for f in formats if shares(format_obj(f, eng.dtype)))
    scores = _score_layers(eng, moe_layers, keys, rounding, state, len(batches), counts, mass, min_tokens,
                           estimate_tokens, N, T, tick, clock)
    sens, flagged = _under_observed(scores, counts, moe_layers, keys, min_tokens, c.num_experts)
    return _fisher_result(eng, keys, scores, sens, flagged, counts, mass, entropy, N, T, probe, min_tokens)


class _Ticker:
    """The progress bar's steps: one per calibration batch, then one per expert of each MoE layer."""

    def __init__(self, progress, total: int):
        self.progress, self.total, self.step = progress, total, 0

    def advance(self, n: int = 1) -> None:
        self.step += n
        self.show(self.step)

    def show(self, step: int) -> None:
        if self.progress:
            self.progress("sensitivity", step, self.total)


def _forward_backward(eng, batches, moe_layers, state: Progress, probe, seed, tick: _Ticker,
                      clock: PhaseClock) -> None:
    """Phase 1: forward + backward per batch; each MoE layer's h, routing and output gradient, and the
    batch's routing statistics, saved to the progress directory (batches already saved are skipped)."""
    for b, batch in enumerate(batches):
        if state.batch_file(b).is_file():
            tick.advance()
            continue
        eng.reset_routing_stats()
        cap: dict[int, dict] = {}

        def hook(li, h, idx, w, out, cap=cap):
            rec = cap[li] = {"h": h.detach().clone(), "idx": idx.detach().clone(), "w": w.detach().float().clone()}
            if out.requires_grad:
                out.register_hook(lambda g, rec=rec: rec.__setitem__("g", g.detach().clone()))

        eng.moe_hook = hook
        try:
            with clock("forward"):
                logits = eng.logits_with_grad(batch)
            with clock("backward"):
                gen = torch.Generator().manual_seed(seed * 1_000_003 + b)
                v = _probe(logits, probe, gen)
                with torch.enable_grad():
                    logits.backward(v)  # the gradient of Σ v·logits, without forming the product
        finally:
            eng.moe_hook = None
        del logits, v
        with clock("io"):
            for l in moe_layers:
                r = cap[l]
                _save({"h": r["h"].cpu(), "g": r["g"].cpu(), "idx": r["idx"].cpu(), "w": r["w"].cpu()},
                      state.act_file(l, b))
            st = eng.routing_stats()
            _save({"counts": st["counts"], "entropy_sum": st["entropy_sum"], "weight_mass": st["weight_mass"],
                   "tokens": st["tokens"]}, state.batch_file(b))
        tick.advance()
    eng.reset_routing_stats()


def _routing_totals(state: Progress, n_batches: int, L: int, E: int):
    """Routed-token counts, routing weight mass [L, E] and entropy sums [L] over every saved batch."""
    counts = torch.zeros(L, E, dtype=torch.int64)
    mass = torch.zeros(L, E, dtype=torch.float64)
    entropy = torch.zeros(L, dtype=torch.float64)
    for b in range(n_batches):
        st = _load(state.batch_file(b), lambda d: _check_batch(d, L, E))
        counts += st["counts"]
        mass += st["weight_mass"]
        entropy += st["entropy_sum"]
    return counts, mass, entropy


def _score_layers(eng, moe_layers, formats, rounding, state: Progress, n_batches: int, counts, mass, min_tokens,
                  estimate_tokens, N: int, T: int, tick: _Ticker, clock: PhaseClock) -> dict:
    """Phase 2: score one MoE layer at a time (layers already scored are read back, and the rounding's
    per-layer state restored). Returns measured / per-sequence / estimated ΔKL per matrix and format
    [L, E], and the token-assignment expert passes the scoring cost."""
    c = eng.cfg
    L, E, k = c.num_layers, c.num_experts, c.top_k
    share = counts.double() / (N * T * k)
    floor = 0.25 * k / E
    zeros = lambda: {f: torch.zeros(L, E, dtype=torch.float64) for f in formats}  # noqa: E731
    measured = {m: zeros() for m in MATRICES}
    per_seq = {m: zeros() for m in MATRICES}
    estimated = {m: zeros() for m in MATRICES}
    scored = 0.0  # token-assignment expert passes (units of one expert's fc + proj on one token)
    cross = bool(moe_layers)  # every layer's roundings scored on rows they were not fitted to
    estimate = 0.0  # of which under-observed experts' estimates
    for l in moe_layers:
        lf = state.layer_file(l)
        lf_existed = lf.is_file()
        if not lf_existed:
            step = tick.step
            scored_layer = _score_layer(eng, l, [state.act_file(l, b) for b in range(n_batches)], formats, rounding,
                                        counts[l], mass[l], min_tokens, estimate_tokens, T, N, share[l], floor,
                                        progress=(lambda e: tick.show(step + e)) if tick.progress else None,
                                        clock=clock)
            with clock("io"):
                _save(scored_layer, lf)
                for b in range(n_batches):
                    state.act_file(l, b).unlink(missing_ok=True)
            del scored_layer
        with clock("io"):
            res = _load(lf, lambda d: _check_layer(d, formats, E))
        if lf_existed and hasattr(rounding, "restore_layer"):
            try:
                rounding.restore_layer(l, res.get("rounding_state"))
            except InputError as e:
                raise InputError(f"resumed calibration progress is unusable: {e.what}", where=str(lf),
                                 hint="its saved progress was discarded; run the command again to start over") from None
        tick.advance(E)
        for m in MATRICES:
            for f in formats:
                measured[m][f][l] = res["measured"][m][f]
                per_seq[m][f][l] = res["per_seq"][m][f]
                estimated[m][f][l] = res["estimated"][m][f]
        scored += res["expert_passes"]
        estimate += res.get("estimate_passes", 0.0)
        cross = cross and bool(res.get("cross_fitted", False))
    shutil.rmtree(state.acts, ignore_errors=True)
    return {"measured": measured, "per_seq": per_seq, "estimated": estimated, "scored": scored,
            "estimate": estimate, "floor": floor, "cross_fitted": cross}


def _tensor(t, shape: tuple, what: str, floating: bool | None = None) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what} is {got}, expected shape {tuple(shape)}")
    if floating is not None and t.is_floating_point() != floating:
        raise ValueError(f"{what} has dtype {t.dtype}")


def _check_batch(d, L: int, E: int) -> None:
    _tensor(d["counts"], (L, E), "counts", False)
    _tensor(d["weight_mass"], (L, E), "weight_mass", True)
    _tensor(d["entropy_sum"], (L,), "entropy_sum", True)


def _check_acts(d, H: int, k: int) -> None:
    n = d["h"].shape[0] if isinstance(d.get("h"), torch.Tensor) and d["h"].dim() == 2 else -1
    _tensor(d["h"], (n, H), "h", True)
    _tensor(d["g"], (n, H), "g", True)
    _tensor(d["idx"], (n, k), "idx", False)
    _tensor(d["w"], (n, k), "w", True)


def _check_layer(d, formats, E: int) -> None:
    for key in ("measured", "per_seq", "estimated"):
        for m in MATRICES:
            for f in formats:
                _tensor(d[key][m][f], (E,), f"{key}.{m}.{f}", True)
    for key in ("expert_passes", "estimate_passes"):
        v = d.get(key, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"{key} is {v!r}")
    if not isinstance(d.get("cross_fitted", False), bool):
        raise ValueError("cross_fitted is not a boolean")
    if not (d.get("rounding_state") is None or isinstance(d["rounding_state"], dict)):
        raise ValueError("rounding_state is not a mapping")


def _under_observed(scores: dict, counts, moe_layers, formats, min_tokens: int, E: int):
    """Sensitivities: the measured ΔKL, or for an expert routed fewer than ``min_tokens`` tokens the
    larger of measured and estimated; and the flagged experts."""
    measured, estimated = scores["measured"], scores["estimated"]
    sens = {m: {f: measured[m][f].clone() for f in formats} for m in MATRICES}
    flagged = []
    for l in moe_layers:
        for e in range(E):
            if counts[l, e] < min_tokens:
                for m in MATRICES:
                    for f in formats:
                        sens[m][f][l, e] = max(float(measured[m][f][l, e]), float(estimated[m][f][l, e]))
                flagged.append({"layer": l, "expert": e, "tokens": int(counts[l, e])})
    return sens, flagged


def _fisher_result(eng, formats, scores: dict, sens, flagged, counts, mass, entropy, N: int, T: int, probe,
                   min_tokens: int) -> dict:
    """The calib.json dict of a Fisher measurement, with its model work in forward-pass equivalents (a
    multiply-accumulate count, deterministic; the measured seconds are recorded apart)."""
    c = eng.cfg
    I, H = c.expert_intermediate_size, c.hidden_size
    tokens = N * T
    macs = forward_macs(c, T)
    fwd = macs["total"] * tokens
    cost = {"forward": 1.0, "backward": (macs["total"] + macs["attention_scores"]) / macs["total"],
            "scoring": (scores["scored"] - scores["estimate"]) * 3 * I * H / fwd,
            "under_observed_estimate": scores["estimate"] * 3 * I * H / fwd}
    cost_total = sum(cost.values())
    stats = {"counts": counts, "weight_mass": mass, "entropy_sum": entropy}
    formats, sensitivity = fisher_sensitivity(formats, scores, sens, probe)
    # Everything counted, the reference pass included (see the module docstring).
    sensitivity.update(cost_forward_passes=cost_total, cost_breakdown=cost)
    return build_result(eng, formats, stats, tokens, min_tokens, flagged, sensitivity)


def fisher_sensitivity(keys, scores: dict, sens: dict, probe: str, runner: str | None = None) -> tuple[list, dict]:
    """The formats measured (``keys`` less the stacked variants) and calib.json's ``sensitivity`` block of a
    Fisher measurement, before its cost figures; ``runner`` names a runner other than the engine's."""
    measured, estimated, per_seq = scores["measured"], scores["estimated"], scores["per_seq"]
    stacked = [f[:-len(STACKED)] for f in keys if f.endswith(STACKED)]
    formats = [f for f in keys if not f.endswith(STACKED)]
    as_lists = lambda d: {f: d[f].tolist() for f in formats}  # noqa: E731
    return formats, {
        "method": "fisher",
        "probe": probe,
        **({"runner": runner} if runner else {}),
        "metric": "mean KL(p_ref || p_quant) per calibration token, nats (second-order Fisher estimate)",
        "delta_kl": {f: (sens["fc"][f] + sens["proj"][f]).tolist() for f in formats},
        "expert_delta_kl": "fc + proj",
        "matrices": {m: {"delta_kl": as_lists(sens[m]), "measured": as_lists(measured[m]),
                         "estimated": as_lists(estimated[m]), "sequence_delta_kl": as_lists(per_seq[m])}
                     for m in MATRICES},
        "floor_share": scores["floor"],
        "cross_fitted": bool(scores.get("cross_fitted", False)),
        **({"stacked": _stacked_block(stacked, sens, measured, estimated)} if stacked else {}),
    }


def _stacked_block(stacked: list[str], sens, measured, estimated) -> dict:
    """calib.json's ``sensitivity.stacked``: ΔKL of the formats TensorRT-LLM's stacked layout rounds
    with a layer-shared pre-quant scale, measured on those weights (what ``--target tensorrt-llm``
    writes), in the layout of ``delta_kl`` / ``matrices``."""
    tl = lambda d, f: d[f + STACKED].tolist()  # noqa: E731
    return {
        "meaning": "ΔKL with the pre-quant scale TensorRT-LLM's stacked MoE layout shares per MoE layer and "
                   "matrix kind (searched on all of the layer's experts); the tensorrt-llm target plans with it",
        "formats": stacked,
        "delta_kl": {f: (sens["fc"][f + STACKED] + sens["proj"][f + STACKED]).tolist() for f in stacked},
        "matrices": {m: {"delta_kl": {f: tl(sens[m], f) for f in stacked},
                         "measured": {f: tl(measured[m], f) for f in stacked},
                         "estimated": {f: tl(estimated[m], f) for f in stacked}} for m in MATRICES},
    }


def _score_layer(eng, l, files, formats, rounding, counts, mass, min_tokens, estimate_tokens, T, N, share,
                 floor, progress=None, clock: PhaseClock | None = None) -> dict:
    """ΔKL estimates of every expert matrix of layer ``l`` from its saved activations. A key of
    ``formats`` ending in ``STACKED`` scores that format as TensorRT-LLM's stacked layout rounds it."""
    c = eng.cfg
    clock = clock if clock is not None else PhaseClock()
    with clock("io"):
        parts = [_load(f, lambda d: _check_acts(d, c.hidden_size, c.top_k)) for f in files]
        h, g, idx, w = (torch.cat([p[n] for p in parts]) for n in ("h", "g", "idx", "w"))
        del parts
    with clock("scoring"):
        return score_layer_tensors(eng, l, h, g, idx, w, formats, rounding, counts, mass, min_tokens,
                                   estimate_tokens, T, N, share, floor, progress)


def _folds(rounding, l, base, h, idx, seq_of, N):
    """Cross-fitting of a rounding fitted to the calibration rows (error-feedback codes, searched
    scales, pre-quant scales and clips): the layer's tokens split in two folds (alternate sequences;
    halves of the tokens when there is one sequence), the rounding fitted again on each, and every row
    scored with the rounding fitted on the other fold, so that a matrix's ΔKL is measured on rows its
    rounding never saw, as the export meets held-out text. (``in_fold1`` [tokens] bool, (rounding fitted
    on fold 0, rounding fitted on fold 1)), or None for a rounding that does not fit to rows (round to
    nearest) or too few tokens."""
    fold = getattr(rounding, "fold", None)
    if fold is None or not getattr(rounding, "cross_fit", False) or getattr(rounding, "name", "rtn") == "rtn" \
            or h.shape[0] < 2:
        return None
    in1 = (seq_of % 2 == 1) if N >= 2 else (torch.arange(h.shape[0], device=h.device) >= h.shape[0] // 2)
    fitted = tuple(fold(l, base, h[mask], idx[mask]) for mask in (~in1, in1))
    if any(r is None for r in fitted):
        return None
    return in1, fitted


def expert_activation(base, hh: torch.Tensor) -> torch.Tensor:
    """The expert's intermediate activation from its fc output ``hh`` = [up; gate] (bias included):
    silu(gate)·up, or the bank's own ``activation`` (a transformers experts module's gating)."""
    act = getattr(base, "activation", None)
    if act is not None:
        return act(hh)
    up, gate = hh.chunk(2, dim=-1)
    return F.silu(gate) * up


def score_layer_tensors(eng, l, h, g, idx, w, formats, rounding, counts, mass, min_tokens, estimate_tokens, T, N,
                        share, floor, progress=None) -> dict:
    """``_score_layer`` on the layer's MoE inputs ``h``, output gradients ``g`` [tokens, H], routed experts
    ``idx`` and routing weights ``w`` [tokens, k] (every calibration token, in order)."""
    c = eng.cfg
    E, k = c.num_experts, c.top_k
    base: FloatExperts = eng.layers[l].experts
    dev = eng.device
    # Scored in float32 whatever the activation dtype (on CUDA bf16/fp16 rounding of y_q - y would swamp
    # an int8 matrix's error); the inputs are the ones the forward pass saw.
    h, g, idx, w = h.to(dev).float(), g.to(dev).float(), idx.to(dev), w.to(dev).float()
    fc_bias = getattr(base, "fc_bias", None)
    n_tok = h.shape[0]
    seq_of = torch.arange(n_tok, device=dev) // T
    rounding.add_layer(l, base, h, idx)
    folds = _folds(rounding, l, base, h, idx, seq_of, N)
    layer_state = getattr(rounding, "layer_state", None)
    tokens = N * T
    out = {key: {m: {f: torch.zeros(E, dtype=torch.float64) for f in formats} for m in MATRICES}
           for key in ("measured", "per_seq", "estimated")}
    passes = est_passes = 0.0
    w_mean = float(mass.sum() / counts.sum()) if int(counts.sum()) else 1.0 / k
    # Under-observed experts share a budget of 1/ESTIMATE_SHARE of the layer's routed scoring, so that
    # the estimate's cost stays bounded however many experts the router starves.
    n_under = int((counts < min_tokens).sum())
    n_est = max(1, min(estimate_tokens, n_tok, n_tok * k // (ESTIMATE_SHARE * max(n_under, 1))))
    est_rows = torch.div(torch.arange(n_est, device=dev) * n_tok, n_est, rounding_mode="floor")
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    bounds = torch.bincount(flat, minlength=E).cumsum(0).tolist()
    start = 0
    for e in range(E):
        sel = order[start:bounds[e]]
        start = bounds[e]
        tok = sel // k
        jobs = [("measured", tok, w.reshape(-1)[sel])]
        if counts[e] < min_tokens:
            jobs.append(("estimated", est_rows, torch.full((len(est_rows),), w_mean, device=dev)))
        packed = {}
        ws = base.row_major(e)
        for f in formats:
            fmt = format_obj(f.removesuffix(STACKED), eng.dtype)
            for m in MATRICES:
                wt = ws[m]
                if f.endswith(STACKED):
                    pk = None
                    if folds is not None and rounding.fits_rows(fmt):  # the codes refitted per fold
                        pk = rounding.quantize_stacked_folds(fmt, base, l, e, m, eng.dtype, folds[1])
                    packed[(f, m)] = (fmt, pk if pk is not None else rounding.quantize_stacked(fmt, base, l, e, m,
                                                                                               eng.dtype))
                elif folds is not None and rounding.fits_rows(fmt):
                    if rounding.keeps_recipe(fmt):  # the whole calibration's search, which convert reuses
                        rounding.quantize(fmt, wt, l, e, m, eng.dtype)
                    packed[(f, m)] = (fmt, tuple(r.quantize(fmt, wt, l, e, m, eng.dtype) for r in folds[1]))
                else:
                    packed[(f, m)] = (fmt, rounding.quantize(fmt, wt, l, e, m, eng.dtype))
        for kind, rows, wts in jobs:
            if len(rows) == 0:
                continue
            x, gt = h[rows], g[rows]
            fc_w, proj_w = base.fc[e].float(), base.proj[e].float()
            hh = x @ fc_w.t()
            bias = None if fc_bias is None else fc_bias[e].to(dev).float()
            a = expert_activation(base, hh if bias is None else hh + bias)
            r = gt @ proj_w  # projᵀ g: g·(proj Δa) = r·Δa, and g·proj(a) = r·a
            gy = (r.double() * a.double()).sum(-1)
            # Once per row: fc and projᵀg (one expert pass); per format 2IH + IH (one pass).
            passes += len(rows) * (1 + len(formats))
            if kind == "estimated":
                est_passes += len(rows) * (1 + len(formats))
            for (f, m), (fmt, pk) in packed.items():
                if isinstance(pk, tuple):  # cross-fitted: each row scored with the other fold's rounding
                    inp = x if m == "fc" else a
                    in1 = folds[0][rows]
                    y = torch.empty(inp.shape[0], ws[m].shape[0], dtype=inp.dtype, device=inp.device)
                    y[in1] = fmt.linear(inp[in1], pk[0]).to(inp.dtype)
                    y[~in1] = fmt.linear(inp[~in1], pk[1]).to(inp.dtype)
                else:
                    y = fmt.linear(x if m == "fc" else a, pk)
                if m == "fc":
                    d = (r * (expert_activation(base, y if bias is None else y + bias) - a)).sum(-1).double()
                else:
                    # g·(proj_q(a) − proj(a)) with the reference term from r; the two dot products are
                    # taken in float64 so that an int8 matrix's small difference survives.
                    d = (gt.double() * y.double()).sum(-1) - gy
                d = d * wts.double()
                if kind == "measured":
                    out["measured"][m][f][e] = 0.5 * float(d.pow(2).sum()) / tokens
                    s = torch.zeros(N, dtype=torch.float64, device=dev).index_add_(0, seq_of[rows], d)
                    out["per_seq"][m][f][e] = 0.5 * float(s.pow(2).sum()) / tokens
                else:
                    # Per-token mean on the layer's tokens, at the share the expert is assumed to see.
                    out["estimated"][m][f][e] = 0.5 * float(d.pow(2).mean()) * k * max(float(share[e]), floor)
        if progress:
            progress(e + 1)
    out["expert_passes"] = passes
    out["estimate_passes"] = est_passes
    out["cross_fitted"] = folds is not None
    out["rounding_state"] = layer_state(l) if layer_state is not None else None
    return out
