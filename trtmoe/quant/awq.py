"""Activation-aware INT4 rounding (``--rounding awq``) from the routed-token activations calibration sees.

Round-to-nearest (``rtn``) quantizes each expert matrix from its weights alone. ``awq`` also uses the
inputs that matrix receives on calibration text — for ``fc`` ([up; gate], w1/w3) the hidden states of
the tokens routed to that expert, for ``proj`` (down, w2) its intermediate activations
``silu(gate x) * up x`` — and picks, among transforms TensorRT-LLM's int4 kernels run unchanged, the one
whose output error on those tokens is smallest:

* Group-wise INT4 (``int4_g128``, ``int4_g64``; W4A16_AWQ): a per-input-channel scale ``s``. The
  matrix stored is ``W·diag(s)`` and its input is multiplied by ``1/s``, which TensorRT-LLM applies as
  the layer's ``prequant_scaling_factor`` ([1, in], model dtype). ``s = act^a / w^(1-a)`` (``act`` the
  mean |x| per input channel over the routed tokens, ``w`` the mean group-normalized |W| per input
  channel) for ``a`` on a 20-point grid over [0, 1], plus ``s = 1``, normalized to a geometric mean of
  one; then a clip search per (output row, group): the group's amax shrunk by a ratio in 1.0 … 0.5
  (21 points, searched coarse to fine: every third, then each group's two neighbours of its best).
* Per-channel INT4 (W4A16): TensorRT-LLM's weight-only per-channel path has no pre-quant scale, so
  only the clip search applies (per output row; the row error is exact there).
* W4A8 AWQ (``w4a8_awq``: INT4 g128 weights, FP8 inputs under a static scale): a pre-quant scale per
  expert matrix on a 20-point grid of ``mean|x|^a``, then a clip per (row, group) of the pre-scaled
  weight, each candidate measured as the kernel runs it (inputs pre-scaled, FP8 under the input scale
  the layer's per-channel input amax gives after the pre-quant scale; ``search_w4a8``). ``fc`` =
  [up; gate] is one matrix, so w1 and w3 of an expert carry the same pre-quant scale, as TensorRT-LLM's
  W4A8 fused MoE needs. Under error-feedback rounding its codes are then chosen on the searched scales
  (``_w4a8_codes``), the FP8 weight rounding in the loop.

Every candidate's error is computed with the exact numerics of the format (weights cast to the model
dtype, scales rounded into it, codes dequantized in it, the input multiplied by the stored pre-quant
scale in the activation dtype), and the final choice is never worse than round-to-nearest on the
calibration rows: RTN is always one of the candidates. Clipping is carried out by clamping the weight
before the format's own ``quantize``, so the packed bytes keep their layout and the TensorRT-LLM
numerics (amax / 7 per group, amax / 8 per channel) hold unchanged; for per-channel layers that
``trtllm-build`` quantizes itself the clamped float weight is what the checkpoint stores.

The embedded engine gets one pre-quant scale per expert matrix; TensorRT-LLM's fused MoE has one per
stacked ``fc`` and ``proj`` of a layer, so for its layout the scale is searched jointly over every
expert of the layer (the summed routed-token error) and then each expert's clip is searched with it.

``gptq`` and ``awq_gptq`` (``trtmoe.quant.gptq``) then choose the codes by error feedback over the input
Gram matrix of every routed token, on round-to-nearest's scales or on awq's pre-quant scale (without
its clip: ``with_codes``); only the codes differ from those roundings, never the scales, layout or
numerics. Layers that ``trtllm-build``
quantizes itself (per-channel W4A16 in TensorRT-LLM's layout) store float weights, so there only the
clip reaches the engine.

Statistics (per MoE layer, expert and matrix): mean |x| over every routed token, the count, and a
bounded, evenly spaced sample of routed-token input rows (what the searches evaluate output error
on). An expert routed fewer than ``MIN_ROUTED`` calibration tokens gets the layer's tokens (routing
ignored) instead. They live in the calibration artifact as ``activations.safetensors``.

The error-feedback roundings need each matrix's Gram matrix over every routed token. For matrices
with at most ``max_gram_in`` inputs (default ``MAX_GRAM_IN``) it is stored; it is in² per matrix, which
for real models (Mixtral-8x7B's w2: 14,336 inputs, 822 MB per expert) is out of reach. For the larger
ones calibration stores the MoE block's input rows of the layer instead (``LayerInputs``: the hidden
states that reach the router and the experts each was routed to, in the activation dtype the experts
saw, one file per MoE layer under ``moe-inputs/``, at most ``MAX_INPUT_TOKENS`` evenly spaced tokens),
and the Gram matrix of one matrix is rebuilt when it is used: ``fc`` from the routed rows, ``proj`` from
``silu(gate x) * up x`` with the float ``fc`` weight, exactly as calibration computed it, so the
codes are those the stored matrix gives on the same tokens. One layer's rows and at most two Gram
matrices (an expert's fc and proj) are held at a time.

Calibration already searches every int4 candidate of every expert matrix, so it keeps what the
searches chose (``RecipeStore``: pre-quant scale and clip per format, expert, matrix and scale sharing,
one file per MoE layer under ``recipes/``, keyed by a fingerprint of the weight's values) and
``convert`` applies them instead of searching again; the error-feedback codes are still chosen at
convert time (storing them would take half the model's size per candidate format). Entries exist for
the whole matrix, so a ``moe_tp`` shard other than the whole is searched as before (a layer's shared
pre-quant scale, searched on whole matrices, is reused at any ``moe_tp``).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import InputError
from ..hf.hashing import sha256_file
from ..hf.safetensors_io import SafetensorsFile, write_file
from ..matmul import linear
from . import fp_gptq, gptq
from .formats import FORMATS, QuantFormat, pack_int4

log = logging.getLogger(__name__)

ROUNDINGS = ("rtn", "awq", "gptq", "awq_gptq")
ERROR_FEEDBACK = ("gptq", "awq_gptq")  # roundings whose codes come from gptq.codes
ROUNDING_HINT = "use rtn, awq, gptq or awq_gptq"
# Calibration's default: awq's scale and clip with error-feedback codes. With convert's default
# candidate formats it takes the graded 4.5-bpw plan from 0.38 / 0.41 to 0.25 / 0.26 of uniform RTN
# int4_g128's held-out KL on the trained Mixtral / Qwen3-MoE fixtures (scripts/bench_quant.py), for
# about twice awq's calibration time and no more forward passes.
DEFAULT_ROUNDING = "awq_gptq"
ALPHA_GRID = tuple(i / 19 for i in range(20))  # 20 points, 0 and 1 included
CLIP_GRID = tuple(1.0 - i / 40 for i in range(21))  # amax × 1.0, 0.975, …, 0.5
# The clip grid is searched coarse to fine: every GRID_STEP-th point and the last, then each (row,
# group)'s two neighbours of its best: 10 of the 21 points. (The pre-quant scale grid is searched
# whole: searched coarse to fine it raised held-out KL on the trained Qwen3-MoE fixture by ~5 %.)
GRID_STEP = 3
MAX_ROWS = 512  # routed-token rows sampled per expert matrix (rebuilt from the layer's stored MoE inputs)
MIN_ROUTED = 16  # fewer routed tokens than this: use the layer's tokens instead
# Every matrix's statistics are rebuilt when used from its layer's stored MoE inputs: at most this many
# tokens per layer (evenly spaced over the calibration tokens), i.e. ≤ MAX_INPUT_TOKENS × hidden ×
# (activation bytes) per MoE layer, whatever the number of experts: about 0.8 GB for a 48-layer,
# 2048-wide model at the default 4,096 calibration tokens, where storing 512 rows of fc and proj inputs
# and a proj Gram matrix per expert matrix would take about 8.9 + 14.5 GB.
MAX_INPUT_TOKENS = 32768
# Error-feedback roundings may instead store X^T X over every routed token for matrices with at most
# this many inputs (in² float32 per expert matrix: 4 MiB at 1024), which matters only when calibration
# has more tokens per layer than MAX_INPUT_TOKENS; 0 (the default) stores none. Without a Gram matrix
# at all they fall back to the sampled rows, and only where those are at least MIN_ROWS_PER_INPUT per
# input channel: with fewer, the codes fit the sample's noise (measured: on 256 rows of 128–256 inputs
# the error on other rows was above awq's alone for proj).
MAX_GRAM_IN = 0
MIN_ROWS_PER_INPUT = 8
GRAM_CHUNK_ROWS = 4096  # rows per float64 accumulation step when a Gram matrix is rebuilt
ACT_FILE = "activations.safetensors"
INPUTS_DIR = "moe-inputs"  # per-layer MoE input rows, beside ACT_FILE
RECIPES_DIR = "recipes"  # per-layer searched pre-quant scales and clips, beside ACT_FILE
# Changes whenever the searches would choose differently on the same inputs (grids, objectives):
# stored recipes of another version are ignored and searched again.
RECIPE_SEARCH = "alpha20-clip21c3-v2"
MATRIX_KINDS = ("fc", "proj")


def applies(fmt: QuantFormat) -> bool:
    """Whether activation-aware rounding changes anything for ``fmt`` (the int4 formats)."""
    return fmt.int4_search is not None


def _grouped(fmt: QuantFormat) -> bool:
    """Whether ``fmt``'s INT4 search is the group-wise one (pre-quant scale, per-group clip); the
    searches below are only reached for formats that ``applies`` to."""
    return fmt.int4_search == "group"


def _w4a8(fmt: QuantFormat) -> bool:
    """Whether ``fmt``'s INT4 search is W4A8 AWQ's (``search_w4a8``: INT4 groups under FP8 inputs)."""
    return fmt.int4_search == "w4a8"


def kept_in_float(rounding: str) -> str:
    """What of ``rounding`` survives in a per-channel int4 layer the checkpoint stores as float weights
    (the layer layout; the engine builder, or the embedded engine at load, rounds them to nearest):
    the clip, never error-feedback codes."""
    return {"gptq": "rtn", "awq_gptq": "awq"}.get(rounding, rounding)


def loses_codes(fmt: QuantFormat, rounding: str) -> bool:
    """Whether ``fmt`` in the layer layout (float weights for per-channel int4) drops the error-feedback
    codes ``rounding`` chooses."""
    return fmt.int4_search == "channel" and rounding in ERROR_FEEDBACK


def shares_prequant(fmt: QuantFormat, rounding: str) -> bool:
    """Whether TensorRT-LLM's stacked layout (one pre-quant scale per MoE layer and matrix kind, searched
    on all of the layer's experts) rounds ``fmt`` differently from the embedded engine's per-matrix
    scale under ``rounding``: the group-wise int4 formats under awq and awq_gptq."""
    return fmt.int4_search == "group" and rounding in ("awq", "awq_gptq")


# ---------------------------------------------------------------------------------------------
# statistics


@dataclass
class MatrixStats:
    """Routed-token inputs of one expert matrix: mean |x| per input channel (float32, every routed
    token), a bounded sample of input rows (the activation dtype), and how many tokens were routed.
    The sample is either stored (``stored_rows``) or rebuilt when used from the layer's stored MoE
    inputs (``inputs``): one layer's tokens × hidden instead of experts × rows × (hidden + FFN)."""

    act_mean: Tensor  # [in]
    stored_rows: Tensor | None  # [n, in]; None: rebuilt from ``inputs``
    count: int
    source: str = "routed"  # "layer": too few routed tokens, the layer's tokens stand in
    gram: Tensor | None = None  # [in, in] X^T X over every routed token (float32), error-feedback roundings
    inputs: "InputRef | None" = None  # where the rows (and, with ``inputs.gram``, X^T X) are rebuilt from
    gram_rows_summed: int | None = None  # what ``gram_count`` says, where it cannot be told again (``on``)

    @property
    def rows(self) -> Tensor:
        """The sampled input rows [n, in] (at most ``MAX_ROWS``, evenly spaced over the routed tokens)."""
        if self.stored_rows is not None:
            return self.stored_rows
        if self.inputs is None:
            raise InputError("activation statistics hold neither input rows nor MoE inputs to rebuild them from",
                             hint="recalibrate this model")
        return self.inputs.rows(self.source == "layer")

    def columns(self, a: int, b: int) -> "MatrixStats":
        """The statistics of input channels [a, b) (a moe_tp shard of ``proj``)."""
        g = None if self.gram is None else self.gram[a:b, a:b]
        ref = None if self.inputs is None else self.inputs.columns(a, b)
        rows = None if self.stored_rows is None else self.stored_rows[:, a:b]
        return MatrixStats(self.act_mean[a:b], rows, self.count, self.source, g, ref, self.gram_rows_summed)

    def gram_matrix(self) -> Tensor | None:
        """X^T X of the routed tokens' inputs (float32): the stored one, or rebuilt from the layer's
        stored MoE inputs; None when there is neither."""
        if self.gram is not None:
            return self.gram
        if self.inputs is not None and self.inputs.gram_rebuilt:
            return self.inputs.gram(self.source == "layer")
        return None

    def gram_count(self) -> int:
        """How many input rows ``gram_matrix`` sums (what its dampening is scaled by, ``gptq.damping``)."""
        if self.gram_rows_summed is not None:
            return self.gram_rows_summed
        if self.gram is None and self.inputs is not None and self.inputs.gram_rebuilt:
            return self.inputs.gram_count(self.source == "layer")
        if self.source == "layer" and self.inputs is not None:  # a stored one over every layer token
            return self.inputs.layer_inputs.tokens
        return self.count

    def gram_rows(self, max_rows: int) -> Tensor | None:
        """The rows X [n, in] that ``gram_matrix`` = XᵀX is rebuilt from (every routed token the layer's
        stored MoE inputs hold), when there are at most ``max_rows`` of them; None otherwise, or when
        the Gram matrix is stored. With fewer rows than inputs, ‖X Dᵀ‖² costs less than tr(D H Dᵀ)."""
        if self.gram is not None or self.inputs is None or not self.inputs.gram_rebuilt:
            return None
        return self.inputs.layer_inputs.gram_rows(self.inputs, self.source == "layer", max_rows)

    def on(self, device: torch.device, gram: bool = True) -> "MatrixStats":
        """These statistics on ``device`` for a search there: the sampled rows, the mean |x| and (with
        ``gram``) the Gram matrix, rebuilt on the host where they are rebuilt and then moved; the rows
        the Gram matrix is made of stay on the host (the searches then take errors through it)."""
        g = self.gram_matrix() if gram else None
        return MatrixStats(self.act_mean.to(device), self.rows.to(device), self.count, self.source,
                           None if g is None else g.to(device), None,
                           None if g is None else self.gram_count())

    def with_fc(self, fc: "Tensor | Callable[[], Tensor]") -> "MatrixStats":
        """These statistics with the float ``fc`` weight [2I, H] of their expert (a tensor or a function
        returning it), which a ``proj`` matrix's rows and Gram matrix are rebuilt with; unchanged when
        none is needed."""
        if self.inputs is None or self.inputs.mod != "proj" or self.inputs.fc is not None:
            return self
        return replace(self, inputs=replace(self.inputs, fc=fc))


@dataclass
class InputRef:
    """Where one expert matrix's sampled rows (at most ``max_rows``) and, with ``gram_rebuilt``, its
    Gram matrix are rebuilt from: its layer's stored MoE inputs, the expert, the matrix kind, the input
    channels [a, b) (None: all) and, for ``proj``, the float ``fc`` weight (a tensor, a function
    returning it, or None until the checkpoint supplies it). Experts whose gating is not silu(gate)·up
    without bias (``own_gating``: a transformers experts module's own, e.g. gpt-oss's clamped swiglu with
    biases) rebuild ``proj``'s inputs with the experts' ``act`` (on [up; gate] pre-activations, bias
    included) and ``bias`` (the expert's fc bias); without ``act`` they cannot be rebuilt."""

    layer_inputs: "LayerInputs"
    expert: int
    mod: str
    cols: tuple[int, int] | None = None
    fc: "Tensor | Callable[[], Tensor] | None" = None
    max_rows: int = MAX_ROWS
    gram_rebuilt: bool = True
    act: "Callable[[Tensor], Tensor] | None" = None
    bias: Tensor | None = None
    own_gating: bool = False

    def columns(self, a: int, b: int) -> "InputRef":
        off = 0 if self.cols is None else self.cols[0]
        return replace(self, cols=(off + a, off + b))

    def gram(self, all_rows: bool) -> Tensor:
        return self.layer_inputs.gram(self, all_rows)

    def rows(self, all_rows: bool) -> Tensor:
        return self.layer_inputs.sampled_rows(self, all_rows)

    def gram_count(self, all_rows: bool) -> int:
        return self.layer_inputs.gram_count(self, all_rows)


def expert_inputs(fc_e: Tensor, x: Tensor, act: "Callable[[Tensor], Tensor] | None" = None,
                  bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The inputs of an expert's two matrices for rows ``x``: ``fc``'s (``x``) and ``proj``'s
    (``silu(gate x) * up x``, ``fc_e`` = [up; gate] [2I, H]; with ``act``, ``act(fc_e x + bias)``: the
    experts' own gating on the [up; gate] pre-activations)."""
    h = x @ fc_e.t()
    if bias is not None:
        h = h + bias.to(device=h.device, dtype=h.dtype)
    if act is not None:
        return x, act(h)
    up, gate = h.chunk(2, dim=-1)
    return x, F.silu(gate) * up


class LayerInputs:
    """One MoE layer's input rows ``x`` [n, H] (the activation dtype the experts computed in) and the
    experts each was routed to ``routed`` [n, k], out of ``tokens`` calibration tokens; in memory, or in
    a file (``path``, checked against ``sha256`` when first read). File-backed rows are read when a Gram
    matrix needs them and dropped when another layer's are read: one layer is resident at a time."""

    def __init__(self, layer: int, x: Tensor | None, routed: Tensor | None, tokens: int,
                 path: Path | None = None, sha256: str | None = None):
        self.layer, self._x, self._routed, self.tokens = layer, x, routed, tokens
        self.path, self.sha256 = path, sha256
        self.n_rows = None if x is None else int(x.shape[0])
        self._checked = False
        self._uid = next(_UIDS)  # what the Gram memo knows these rows by

    @classmethod
    def sample(cls, layer: int, x_all: Tensor, routed: Tensor, max_tokens: int) -> "LayerInputs":
        n = x_all.shape[0]
        routed = routed.reshape(n, -1)
        if n > max_tokens:
            idx = torch.div(torch.arange(max_tokens, dtype=torch.int64) * n, max_tokens, rounding_mode="floor")
            x_all, routed = x_all[idx], routed[idx]
        return cls(layer, x_all.detach().cpu().clone(), routed.cpu().to(torch.int32).contiguous(), n)

    def write(self, path: Path) -> str:
        """Write the rows to ``path`` (deterministic bytes); from then on they are read from it."""
        x, routed = self._tensors()
        sha = write_file(path, [("x", x.contiguous()), ("routed", routed.contiguous())],
                         metadata={"format": "trtmoe-moe-inputs", "layer": str(self.layer),
                                   "tokens": str(self.tokens)})
        self.path, self.sha256, self._checked = Path(path), sha, True
        _resident(self)  # just written: the caller uses them next
        return sha

    @property
    def rows(self) -> int:
        return self.n_rows if self.n_rows is not None else int(self._tensors()[0].shape[0])

    def _tensors(self) -> tuple[Tensor, Tensor]:
        with _LOCK:
            if self._x is None:
                self._x, self._routed = self._read()
                _resident(self)
            return self._x, self._routed

    def release(self) -> None:
        if self.path is not None:
            self._x = self._routed = None

    def _read(self) -> tuple[Tensor, Tensor]:
        p = self.path
        what = f"stored MoE inputs of layer {self.layer}"
        hint = _INPUTS_HINT
        if p is None or not p.is_file():
            raise InputError(f"{what} are missing", where=str(p), hint=hint)
        if not self._checked and self.sha256 is not None and sha256_file(p) != self.sha256:
            raise InputError(f"{what} do not match their recorded sha256 (the file is damaged or was replaced)",
                              where=str(p), hint=hint)
        try:
            f = SafetensorsFile(p)
            try:
                x, routed = f.read("x"), f.read("routed")
            finally:
                f.close()
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same one-line error
            raise InputError(f"{what} are unreadable ({e})", where=str(p), hint=hint) from None
        if x.dim() != 2 or routed.dim() != 2 or routed.shape[0] != x.shape[0]:
            raise InputError(f"{what} have shapes {tuple(x.shape)} and {tuple(routed.shape)}", where=str(p),
                              hint=hint)
        self._checked = True
        return x, routed

    def _matrix_inputs(self, ref: InputRef, all_rows: bool) -> tuple[Tensor, "Callable[[Tensor], Tensor] | None"]:
        """The rows routed to ``ref``'s expert (every row with ``all_rows``) and, for ``proj``, what
        turns them into proj's inputs (the expert's ``fc`` in the rows' dtype, and its gating)."""
        x_all, routed = self._tensors()
        x = x_all if all_rows else x_all[routed.eq(ref.expert).any(-1)]
        if ref.mod != "proj":
            return x, None
        fc = ref.fc() if callable(ref.fc) else ref.fc
        if fc is None:
            raise InputError(f"layer {self.layer} expert {ref.expert} proj: its inputs are rebuilt "
                             "from the fc weight, which was not given")
        if ref.own_gating and ref.act is None:
            raise InputError(f"layer {self.layer} expert {ref.expert} proj: its inputs are rebuilt with the "
                             "experts' own gating (not silu(gate)·up), which only the calibration has",
                             hint="use --rounding rtn for this model")
        fc = fc.to(device=x.device, dtype=x.dtype)
        return x, lambda part: expert_inputs(fc, part, ref.act, ref.bias)[1]

    def sampled_rows(self, ref: InputRef, all_rows: bool) -> Tensor:
        """At most ``ref.max_rows`` input rows of ``ref``'s matrix, evenly spaced over its routed rows
        (over every row with ``all_rows``); the same rows at calibration and at conversion."""
        key = ("rows", self._uid, ref.expert, ref.mod, ref.cols, all_rows, ref.max_rows)
        with _LOCK:
            if key in _GRAM:
                return _GRAM[key]
        x, to_proj = self._matrix_inputs(ref, all_rows)
        x = _sample(x, ref.max_rows)
        if to_proj is not None:
            x = to_proj(x)
        if ref.cols is not None:
            x = x[:, ref.cols[0]:ref.cols[1]].contiguous()
        _remember(key, x)
        return x

    def gram_rows(self, ref: InputRef, all_rows: bool, max_rows: int) -> Tensor | None:
        """The rows ``gram`` sums over (``ref``'s matrix inputs, in the activation dtype), or None when
        there are more than ``max_rows``."""
        x_all, routed = self._tensors()
        n = x_all.shape[0] if all_rows else int(routed.eq(ref.expert).any(-1).sum())
        if n > max_rows:
            return None
        key = ("gram_rows", self._uid, ref.expert, ref.mod, ref.cols, all_rows)
        with _LOCK:
            if key in _GRAM:
                return _GRAM[key]
        x, to_proj = self._matrix_inputs(ref, all_rows)
        y = x if to_proj is None else to_proj(x)
        y = y if ref.cols is None else y[:, ref.cols[0]:ref.cols[1]].contiguous()
        _remember(key, y)
        return y

    def gram_count(self, ref: InputRef, all_rows: bool) -> int:
        """How many rows ``gram`` sums for ``ref``'s matrix."""
        x_all, routed = self._tensors()
        return int(x_all.shape[0]) if all_rows else int(routed.eq(ref.expert).any(-1).sum())

    def gram(self, ref: InputRef, all_rows: bool) -> Tensor:
        """X^T X (float32, accumulated in float64) of ``ref``'s matrix over the routed rows (every row
        with ``all_rows``: the expert saw too few tokens, calibration used the layer's)."""
        key = ("gram", self._uid, ref.expert, ref.mod, ref.cols, all_rows)
        with _LOCK:
            if key in _GRAM:
                return _GRAM[key]
        x, to_proj = self._matrix_inputs(ref, all_rows)

        def rows(part: Tensor) -> Tensor:  # the matrix's inputs for some of the rows
            y = part if to_proj is None else to_proj(part)
            return y if ref.cols is None else y[:, ref.cols[0]:ref.cols[1]]

        # A chunk of rows at a time: proj's inputs (I wide) are never formed for all rows at once.
        g = gptq.gram_chunked(x, GRAM_CHUNK_ROWS, rows)
        _remember(key, g)
        return g


def _remember(key: tuple, t: Tensor) -> None:
    with _LOCK:
        while len(_GRAM) >= _GRAMS_KEPT:
            _GRAM.pop(next(iter(_GRAM)))
        _GRAM[key] = t


_INPUTS_HINT = "recalibrate (trtmoe calibrate ...), or convert with --rounding rtn"
_LOCK = threading.RLock()
_UIDS = itertools.count()
_RESIDENT: list = []  # the file-backed LayerInputs whose rows are in memory (at most one)
_GRAM: dict = {}  # the last rebuilt Gram matrices and row samples (an expert's formats reuse them)
# An expert's fc and proj, rows, Gram and Gram rows, for the whole calibration's statistics and each
# cross-fitting fold's: calibration rounds them in turn per format (with 6, cross-fitted scoring rebuilt
# every Gram matrix once per format: 576 rebuilds instead of 192 for the trained Mixtral fixture's 4 formats).
_GRAMS_KEPT = 18


def _resident(li: LayerInputs) -> None:
    with _LOCK:
        for other in _RESIDENT:
            if other is not li:
                other.release()
        _RESIDENT[:] = [li]
        for key in [k for k in _GRAM if k[1] != li._uid]:
            del _GRAM[key]


def _sample(x: Tensor, n: int) -> Tensor:
    """``n`` rows of ``x`` evenly spaced over it (all rows when it has no more)."""
    if x.shape[0] <= n:
        return x.clone()
    idx = torch.div(torch.arange(n, dtype=torch.int64) * x.shape[0], n, rounding_mode="floor")
    return x[idx].clone()


def collect_layer(fc: Tensor, proj: Tensor, x_all: Tensor, routed: Tensor, *, max_rows: int = MAX_ROWS,
                  min_routed: int = MIN_ROUTED, gram: bool = False, max_gram_in: int = MAX_GRAM_IN,
                  max_input_tokens: int = MAX_INPUT_TOKENS, layer: int = -1,
                  fc_bias: Tensor | None = None, activation: "Callable[[Tensor], Tensor] | None" = None
                  ) -> dict[tuple[int, str], MatrixStats]:
    """Statistics of every expert matrix of one MoE layer. ``fc`` [E, 2I, H] ([up; gate]) and ``proj``
    [E, H, I] are the float expert weights, ``x_all`` [tokens, H] the layer's inputs, ``routed``
    [tokens, k] the experts each token was routed to. Returns ``{(expert, "fc" | "proj"): stats}``.

    Each matrix keeps its mean |input| over every routed token and its routed-token count; its sampled
    rows are rebuilt when used from the layer's MoE inputs (``LayerInputs`` of at most
    ``max_input_tokens`` tokens, shared by the layer's matrices). ``gram`` also gives each matrix its
    input Gram matrix (error-feedback roundings): stored (over every routed token) for matrices with
    at most ``max_gram_in`` inputs, rebuilt from those inputs when used for larger ones.

    ``fc_bias`` [E, 2I] (same row order as ``fc``) and ``activation`` (the experts' own gating on the
    [up; gate] pre-activations, bias included) describe experts that are not silu(gate)·up without bias
    (a transformers experts module's; ``InputRef.own_gating``): proj's inputs are then theirs."""
    own = fc_bias is not None or activation is not None
    out = {}
    n = x_all.shape[0]
    routed = routed.reshape(n, -1)
    inputs = LayerInputs.sample(layer, x_all, routed, max_input_tokens)
    store = {m: gram and k <= max_gram_in for m, k in (("fc", fc.shape[-1]), ("proj", proj.shape[-1]))}
    for e in range(fc.shape[0]):
        mask = routed.eq(e).any(-1)
        count = int(mask.sum())
        x, source = (x_all[mask], "routed") if count >= min_routed else (x_all, "layer")
        bias = None if fc_bias is None else fc_bias[e]
        x, a = expert_inputs(fc[e], x, activation, bias)
        for m, rows in (("fc", x), ("proj", a)):
            proj = m == "proj"
            ref = InputRef(inputs, e, m, fc=fc[e] if proj else None, max_rows=max_rows,
                           gram_rebuilt=gram and not store[m], act=activation if proj else None,
                           bias=bias if proj else None, own_gating=own and proj)
            g = gptq.gram(rows) if store[m] else None
            out[(e, m)] = MatrixStats(rows.double().abs().mean(0).float(), None, count, source, g, ref)
    return out


def layer_state(stats: dict[tuple[int, str], MatrixStats]) -> dict:
    """One MoE layer's statistics ``{(expert, matrix): stats}`` as plain data (numbers, strings,
    tensors; ``tree_file`` stores it): the rows of the layer's MoE inputs themselves, never the
    model's weights (a proj matrix's ``fc`` is supplied again when used)."""
    shared: list[LayerInputs] = []
    out = []
    for (e, m), s in sorted(stats.items()):
        ref = None
        if s.inputs is not None:
            li = s.inputs.layer_inputs
            if not any(li is x for x in shared):
                shared.append(li)
            ref = {"layer_inputs": next(i for i, x in enumerate(shared) if x is li),
                   "cols": None if s.inputs.cols is None else list(s.inputs.cols),
                   "max_rows": s.inputs.max_rows, "gram_rebuilt": bool(s.inputs.gram_rebuilt)}
            if s.inputs.own_gating:
                ref["own_gating"] = True
        out.append({"expert": int(e), "mod": m, "act_mean": s.act_mean, "rows": s.stored_rows, "count": int(s.count),
                    "source": s.source, "gram": s.gram, "inputs": ref})
    return {"layer_inputs": [dict(zip(("x", "routed"), li._tensors()), layer=li.layer, tokens=li.tokens)
                             for li in shared], "stats": out}


def layer_from_state(state: dict) -> dict[tuple[int, str], MatrixStats]:
    """The statistics ``layer_state`` recorded. InputError for anything but what it writes."""
    try:
        lis = []
        for d in state["layer_inputs"]:
            x, routed = d["x"], d["routed"]
            if not (isinstance(x, Tensor) and isinstance(routed, Tensor) and x.dim() == 2 and routed.dim() == 2
                    and x.shape[0] == routed.shape[0] and not routed.is_floating_point()):
                raise ValueError("MoE inputs of the wrong shape or type")
            lis.append(LayerInputs(int(d["layer"]), x, routed, int(d["tokens"])))
        out = {}
        for d in state["stats"]:
            ref = d["inputs"]
            if ref is not None:
                cols = None if ref["cols"] is None else (int(ref["cols"][0]), int(ref["cols"][1]))
                ref = InputRef(lis[int(ref["layer_inputs"])], int(d["expert"]), d["mod"], cols,
                               max_rows=int(ref["max_rows"]), gram_rebuilt=bool(ref["gram_rebuilt"]),
                               own_gating=bool(ref.get("own_gating", False)))
            for t in (d["act_mean"], d["rows"], d["gram"]):
                if t is not None and not isinstance(t, Tensor):
                    raise ValueError("a statistic that is not a tensor")
            if d["mod"] not in MATRIX_KINDS or d["source"] not in ("routed", "layer") \
                    or not isinstance(d["act_mean"], Tensor):
                raise ValueError(f"unknown matrix {d['mod']!r} or source {d['source']!r}")
            out[(int(d["expert"]), d["mod"])] = MatrixStats(d["act_mean"], d["rows"], int(d["count"]), d["source"],
                                                            d["gram"], ref)
        return out
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise InputError(f"saved layer statistics are malformed ({str(e)[:100]})") from None


class ActivationStats:
    """Per (layer, expert, matrix) statistics; saved as one safetensors file in the calibration
    artifact (deterministic bytes: fixed tensor order, no timestamps), and, where Gram matrices are
    rebuilt, one file of MoE inputs per layer in ``INPUTS_DIR`` beside it. With ``inputs_dir`` a
    layer's inputs are written there as soon as the layer is added (streamed: earlier layers' rows do
    not stay in memory)."""

    def __init__(self, stats: dict[tuple[int, int, str], MatrixStats] | None = None, max_rows: int = MAX_ROWS,
                 inputs_dir: str | Path | None = None, *, rows_from: "_LayerRows | None" = None):
        self.stats = dict(stats or {})
        self.max_rows = max_rows
        self.inputs_dir = None if inputs_dir is None else Path(inputs_dir)
        self._rows_from = rows_from  # loaded from a file: sampled rows and Gram matrices read per layer
        # Searched transforms (see RecipeStore): kept by calibration, read back by convert.
        self.recipes = RecipeStore(None if inputs_dir is None else Path(inputs_dir).parent / RECIPES_DIR)

    def add_layer(self, layer: int, per_expert: dict[tuple[int, str], MatrixStats]) -> None:
        for (e, m), s in per_expert.items():
            self.stats[(layer, e, m)] = s
        for li in self._layer_inputs(layer):
            if li.layer != layer:
                li.layer = layer
            if self.inputs_dir is not None and li.path is None:
                self.inputs_dir.mkdir(parents=True, exist_ok=True)
                li.write(self.inputs_dir / f"{layer}.safetensors")

    def _layer_inputs(self, layer: int | None = None) -> list[LayerInputs]:
        seen: dict[int, LayerInputs] = {}
        for (l, _, _), s in sorted(self.stats.items()):
            if s.inputs is not None and (layer is None or l == layer):
                seen.setdefault(id(s.inputs.layer_inputs), s.inputs.layer_inputs)
        return list(seen.values())

    def get(self, layer: int, expert: int, mod: str) -> MatrixStats | None:
        if self._rows_from is not None:
            self._rows_from.ensure(layer, self.stats)
        return self.stats.get((layer, expert, mod))

    def check_inputs(self) -> None:
        """InputError naming the first stored MoE-inputs file that is missing (before any is needed)."""
        for li in self._layer_inputs():
            if li.path is not None and not li.path.is_file():
                raise InputError(f"stored MoE inputs of layer {li.layer} are missing", where=str(li.path),
                                 hint=_INPUTS_HINT)

    def summary(self, max_input_tokens: int = MAX_INPUT_TOKENS) -> dict:
        """calib.json's record of these statistics (``max_input_tokens``: the per-layer row cap the
        MoE inputs were sampled under)."""
        layer_src = sorted({(l, e) for (l, e, _), s in self.stats.items() if s.source == "layer"})
        out = {"file": ACT_FILE, "rows_per_matrix": self.max_rows, "min_routed_tokens": MIN_ROUTED,
               "matrices": len(self.stats),
               "layer_tokens_used_for": [{"layer": l, "expert": e} for l, e in layer_src]}
        grams = sum(s.gram is not None for s in self.stats.values())
        if grams:
            out["gram_matrices"] = grams  # X^T X over every routed token (error-feedback roundings)
        rebuilt = sum(s.inputs is not None and s.inputs.gram_rebuilt and s.gram is None for s in self.stats.values())
        if rebuilt:  # the others' X^T X is rebuilt when used from the layers' stored MoE inputs
            out["gram_from_inputs"] = rebuilt
        from_inputs = sum(s.stored_rows is None and s.inputs is not None for s in self.stats.values())
        if from_inputs:  # their sampled rows too
            out["rows_from_inputs"] = from_inputs
        lis = self._layer_inputs()
        if lis:
            out["inputs"] = {"dir": INPUTS_DIR, "layers": len(lis),
                             "rows_per_layer": max(li.rows for li in lis), "max_rows_per_layer": max_input_tokens}
        return out

    def save(self, path: str | Path) -> str:
        path = Path(path)
        items = []
        layers: dict[str, dict] = {}
        for li in self._layer_inputs():  # inputs not streamed yet (no inputs_dir, or another one)
            f = path.parent / INPUTS_DIR / f"{li.layer}.safetensors"
            if li.path is None or li.path.resolve() != f.resolve():
                f.parent.mkdir(parents=True, exist_ok=True)
                li.write(f)
            layers[str(li.layer)] = {"file": f"{INPUTS_DIR}/{f.name}", "sha256": li.sha256, "tokens": li.tokens}
        for (l, e, m) in sorted(self.stats):
            s = self.get(l, e, m)  # layer by layer: a loaded one reads each layer's rows as it goes
            p = f"{l}.{e}.{m}."
            items += [(p + "act_mean", s.act_mean.contiguous()),
                      (p + "count", torch.tensor([s.count], dtype=torch.int64)),
                      (p + "layer_tokens", torch.tensor([int(s.source == "layer")], dtype=torch.int64))]
            if s.stored_rows is not None:
                items.append((p + "rows", s.stored_rows.contiguous()))
            elif s.inputs is not None:  # the sample rebuilt from the layer's inputs
                items.append((p + "rows_from_inputs", torch.tensor([s.inputs.max_rows], dtype=torch.int64)))
            if s.gram is not None:
                items.append((p + "gram", s.gram.contiguous()))
            elif s.inputs is not None and s.inputs.gram_rebuilt:  # X^T X rebuilt from the layer's inputs
                items.append((p + "gram_from_inputs", torch.tensor([1], dtype=torch.int64)))
            if s.inputs is not None and s.inputs.own_gating:  # rebuilt only with the experts' own gating
                items.append((p + "own_gating", torch.tensor([1], dtype=torch.int64)))
        meta = {"format": "trtmoe-activations", "rows": str(self.max_rows)}
        if layers:
            meta["moe_inputs"] = json.dumps(layers, sort_keys=True)
        recipes = self.recipes.save(path.parent / RECIPES_DIR)
        if recipes:
            meta["recipes"] = json.dumps({"search": RECIPE_SEARCH, "layers": recipes}, sort_keys=True)
        return write_file(path, items, metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "ActivationStats":
        f = SafetensorsFile(path)
        try:
            keys = {tuple(n.split(".")[:3]) for n in f.tensors}
            inputs = _layer_inputs_of(Path(path), (f.metadata or {}).get("moe_inputs"))
            stats = {}
            rows = int((f.metadata or {}).get("rows", MAX_ROWS))
            for l, e, m in keys:
                p = f"{l}.{e}.{m}."
                ref = None
                rebuilt = p + "gram_from_inputs" in f.tensors
                if rebuilt or p + "rows_from_inputs" in f.tensors:
                    if int(l) not in inputs:
                        raise KeyError(f"moe_inputs of layer {l}")
                    n_rows = int(f.read(p + "rows_from_inputs")[0]) if p + "rows_from_inputs" in f.tensors else rows
                    ref = InputRef(inputs[int(l)], int(e), m, max_rows=n_rows, gram_rebuilt=rebuilt,
                                   own_gating=p + "own_gating" in f.tensors)
                stored = p + "rows" in f.tensors
                if not stored and (ref is None or p + "rows_from_inputs" not in f.tensors):
                    raise KeyError(f"{p}rows or {p}rows_from_inputs")  # refused now, not when the layer is read
                # Stored rows and Gram matrices are the bulk: read per layer when used.
                stats[(int(l), int(e), m)] = MatrixStats(
                    f.read(p + "act_mean").float(), _NOT_READ if stored else None, int(f.read(p + "count")[0]),
                    "layer" if int(f.read(p + "layer_tokens")[0]) else "routed",
                    _NOT_READ if p + "gram" in f.tensors else None, ref)
            recipes = RecipeStore.of_file(Path(path), (f.metadata or {}).get("recipes"))
        except (KeyError, ValueError, TypeError) as e:
            raise InputError(f"activation statistics are malformed ({e})", where=str(path)) from None
        finally:
            f.close()
        out = cls(stats, rows, rows_from=_LayerRows(Path(path)))
        out.recipes = recipes
        return out


class RecipeStore:
    """The transforms the searches chose (pre-quant scale and clip, before error-feedback codes), per
    MoE layer, so that convert applies calibration's choices instead of searching again: the searches
    are deterministic functions of the weight, the statistics and the model dtype, so a stored entry
    whose weight fingerprint matches is exactly what the search would return.

    An entry is named by ``recipe_id`` (format, expert, matrix, moe_tp shard, shared scale, dtype) or
    ``prequant_id`` (a layer's shared pre-quant scale) and holds the fingerprint of the weight(s) it
    was searched on. Calibration keeps entries while a layer is scored and writes each layer to
    ``recipes/<layer>.safetensors`` when its scoring ends (``flush``); a loaded store reads a layer's
    file, sha256-checked, when first asked. Anything missing, stale or unreadable reads as absent:
    the caller searches as before (a stored recipe only saves time, it never changes the result)."""

    def __init__(self, out_dir: Path | None = None):
        self.out_dir = out_dir  # where flush() writes (calibration); None: kept until save()
        # rid -> [fingerprint, pq, clip, choice of with_codes or None], per layer
        self._mem: dict[int, dict[str, list]] = {}
        self._files: dict[int, tuple[Path, str]] = {}  # layer -> (file, sha256)
        self._read: dict[int, dict[str, list]] = {}
        self._aliases: dict[tuple[int, str], list[str]] = {}  # (layer, rid) -> the names kept beside it
        self._lock = threading.Lock()

    @classmethod
    def of_file(cls, act_file: Path, meta: str | None) -> "RecipeStore":
        out = cls()
        try:
            d = json.loads(meta) if meta else {}
            if d.get("search") == RECIPE_SEARCH:
                for l, v in d["layers"].items():
                    out._files[int(l)] = (act_file.parent / v["file"], str(v["sha256"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            out._files.clear()  # unreadable record: searched again
        return out

    def keep(self, layer: int, rid: str, fingerprint: str, pq: Tensor | None, clip: Tensor | None,
             aliases: "list[tuple[str, str, torch.dtype]]" = ()) -> None:
        """Keep (pq, clip) searched for ``rid`` on a weight with this fingerprint, and under each
        alias (name, fingerprint of the weight in ``dtype``, ``dtype``) the same values rounded into
        that dtype (``keep_choice`` records the choice for them all)."""
        with self._lock:
            mem = self._mem.setdefault(layer, {})
            mem[rid] = [fingerprint, None if pq is None else pq.detach().cpu().contiguous(),
                        None if clip is None else clip.detach().cpu().contiguous(), None]
            for name, fp, dt in aliases:
                mem[name] = [fp, None if pq is None else pq.detach().cpu().to(dt).contiguous(),
                             None if clip is None else _in_dtype(clip.detach().cpu(), dt).contiguous(), None]
            self._aliases[(layer, rid)] = [name for name, _, _ in aliases]

    def keep_choice(self, layer: int, rid: str, choice: int) -> None:
        """Which of ``with_codes``' candidates won for the kept entry ``rid`` (and its aliases)."""
        with self._lock:
            for name in [rid, *self._aliases.get((layer, rid), ())]:
                ent = (self._mem.get(layer) or {}).get(name)
                if ent is not None:
                    ent[3] = int(choice)

    def get(self, layer: int, rid: str, fingerprint: str) -> tuple[Tensor | None, Tensor | None, int | None] | None:
        """(pq, clip, choice) stored for ``rid`` on a weight with this fingerprint, or None (search)."""
        with self._lock:
            ent = (self._mem.get(layer) or self._layer(layer)).get(rid)
        if ent is None or ent[0] != fingerprint:
            return None
        return ent[1], ent[2], ent[3]

    def _layer(self, layer: int) -> dict:
        if layer in self._read:
            return self._read[layer]
        got: dict = {}
        if layer in self._files:
            path, sha = self._files[layer]
            try:
                if path.is_file() and sha256_file(path) == sha:
                    f = SafetensorsFile(path)
                    try:
                        for i, (rid, fp, has_pq, has_clip, choice) in enumerate(json.loads(f.metadata["entries"])):
                            got[rid] = [fp, f.read(f"{i}.pq") if has_pq else None,
                                        f.read(f"{i}.clip") if has_clip else None,
                                        None if choice is None else int(choice)]
                    finally:
                        f.close()
            except Exception:  # noqa: BLE001 - a damaged store is only a lost shortcut
                got = {}
        self._read = {layer: got}  # one layer at a time: convert writes layer by layer
        return got

    def layer_state(self, layer: int) -> dict:
        """The layer's kept entries, {rid: [fingerprint, pq, clip, choice]} (resumable calibration
        progress stores them with ``tree_file``)."""
        with self._lock:
            return {rid: list(ent) for rid, ent in (self._mem.get(layer) or {}).items()}

    def restore(self, layer: int, entries: dict | None) -> None:
        if entries:
            for rid, ent in entries.items():
                ok = (isinstance(ent, (list, tuple)) and len(ent) == 4 and isinstance(ent[0], str)
                      and all(t is None or isinstance(t, Tensor) for t in ent[1:3])
                      and (ent[3] is None or (isinstance(ent[3], int) and not isinstance(ent[3], bool))))
                if not ok:
                    raise InputError(f"saved recipe {rid!r} is malformed")
            with self._lock:
                self._mem[layer] = {rid: list(ent) for rid, ent in entries.items()}
            self.flush(layer)

    def flush(self, layer: int) -> None:
        """Write the layer's kept entries to ``out_dir`` and drop them from memory."""
        if self.out_dir is None or not self._mem.get(layer):
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._write(layer, self.out_dir / f"{layer}.safetensors")

    def _write(self, layer: int, path: Path) -> None:
        with self._lock:
            ents = sorted(self._mem.pop(layer, {}).items())
            for key in [k for k in self._aliases if k[0] == layer]:
                del self._aliases[key]
        items, index = [], []
        for i, (rid, (fp, pq, clip, choice)) in enumerate(ents):
            index.append([rid, fp, pq is not None, clip is not None, choice])
            items += [(f"{i}.pq", pq)] if pq is not None else []
            items += [(f"{i}.clip", clip)] if clip is not None else []
        sha = write_file(path, items, metadata={"format": "trtmoe-recipes", "layer": str(layer),
                                                 "search": RECIPE_SEARCH, "entries": json.dumps(index)})
        self._files[layer] = (path, sha)
        self._read.pop(layer, None)  # read before this file existed: read it again when asked

    def save(self, out_dir: Path) -> dict[str, dict]:
        """Write what is still in memory into ``out_dir``; the record of every layer's file, relative to
        ``out_dir``'s parent (the activations file's directory)."""
        for layer in sorted(self._mem):
            out_dir.mkdir(parents=True, exist_ok=True)
            self._write(layer, out_dir / f"{layer}.safetensors")
        return {str(l): {"file": f"{RECIPES_DIR}/{p.name}", "sha256": sha}
                for l, (p, sha) in sorted(self._files.items()) if p.parent.resolve() == out_dir.resolve()}


def recipe_id(fmt_name: str, expert: int, mod: str, shard: tuple[int, int], shared: bool, dtype: torch.dtype) -> str:
    return f"{fmt_name}|{expert}|{mod}|{shard[0]}x{shard[1]}|{'layer' if shared else 'own'}|{dtype}"


def prequant_id(fmt_name: str, mod: str, dtype: torch.dtype) -> str:
    return f"{fmt_name}|layer-prequant|{mod}|{dtype}"


_NOT_READ = torch.empty(0)  # stands for a tensor a loaded ActivationStats reads when its layer is used


class _LayerRows:
    """Reads one layer's sampled rows and stored Gram matrices into an ActivationStats on first use
    and keeps at most ``keep`` layers read, so converting a model holds a layer's worth, not the
    whole file (about 10 GB of rows for a Mixtral-8x7B-sized model). Layers are read again when
    asked for after they were dropped."""

    def __init__(self, path: Path, keep: int = 2):
        self.path, self.keep = path, keep
        self.read: list[int] = []  # layers whose tensors are in memory, oldest first
        self.lock = threading.Lock()

    def ensure(self, layer: int, stats: dict[tuple[int, int, str], MatrixStats]) -> None:
        with self.lock:
            if layer in self.read:
                return
            keys = [k for k in stats if k[0] == layer]
            if keys:
                f = SafetensorsFile(self.path)
                try:
                    for k in keys:
                        p, s = "{}.{}.{}.".format(*k), stats[k]
                        gram = None if s.gram is None else f.read(p + "gram").float()
                        rows = None if s.stored_rows is None else f.read(p + "rows")
                        stats[k] = replace(s, stored_rows=rows, gram=gram)
                except (KeyError, ValueError, TypeError) as e:
                    raise InputError(f"activation statistics are malformed ({e})", where=str(self.path)) from None
                finally:
                    f.close()
            self.read.append(layer)
            while len(self.read) > self.keep:
                old = self.read.pop(0)
                for k in [k for k in stats if k[0] == old]:
                    s = stats[k]
                    stats[k] = replace(s, stored_rows=None if s.stored_rows is None else _NOT_READ,
                                       gram=None if s.gram is None else _NOT_READ)


def _layer_inputs_of(act_file: Path, meta: str | None) -> dict[int, LayerInputs]:
    """The file-backed MoE inputs an activations file names (read when first used)."""
    if not meta:
        return {}
    out = {}
    for l, d in json.loads(meta).items():
        out[int(l)] = LayerInputs(int(l), None, None, int(d["tokens"]), act_file.parent / d["file"], d["sha256"])
    return out


# ---------------------------------------------------------------------------------------------
# exact numerics of the int4 formats (what the packed bytes dequantize to)


def _in_dtype(w: Tensor, dtype: torch.dtype) -> Tensor:
    return w.to(dtype).to(torch.float32)


def _fake_group(wd: Tensor, g: int, dtype: torch.dtype, clip: Tensor | None = None,
                amax: Tensor | None = None) -> Tensor:
    """What GroupInt4Format stores for ``wd`` (float32 holding model-dtype values) clamped to ±clip
    per (row, group), dequantized the way its ``linear`` does. (The searches call this for every
    candidate: it works in place on one weight-sized buffer, the same operations element by element;
    ``amax``: the |wd| maximum per (row, group), when the caller has it.)"""
    out_f, in_f = wd.shape
    wg = wd.reshape(out_f, in_f // g, g)
    amax = wg.abs().amax(-1) if amax is None else amax
    if clip is not None:
        amax = torch.minimum(amax, clip)
        lim = amax.unsqueeze(-1)
        q = torch.clamp(wg, -lim, lim)  # lim >= 0: max(min(w, lim), -lim)
    scale = amax / 7.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.div(wg, scale.unsqueeze(-1)) if clip is None else q.div_(scale.unsqueeze(-1))
    q = q.round_().clamp_(-8, 7).to(dtype)
    return q.mul_(scale.to(dtype).unsqueeze(-1)).float().reshape(out_f, in_f)


def _fake_channel(wd: Tensor, dtype: torch.dtype, clip: Tensor | None = None) -> Tensor:
    """What PerChannelIntFormat (int4) stores for ``wd`` clamped to ±clip per row, dequantized."""
    amax = wd.abs().amax(-1)
    if clip is not None:
        amax = torch.minimum(amax, clip)
        wd = torch.maximum(torch.minimum(wd, amax.unsqueeze(-1)), -amax.unsqueeze(-1))
    scale = amax / 8.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = wd / safe.unsqueeze(-1)
    q = (q.abs() + 0.5).floor_().mul_(q.sign()).clamp_(-8, 7).to(dtype)
    return q.mul_(scale.to(dtype).unsqueeze(-1)).float()


def _scaled_input(x: Tensor, pq: Tensor | None) -> Tensor:
    """The matrix input as the kernel sees it: ``x * pq`` in the activation dtype, then float32."""
    return x.float() if pq is None else (x * pq.to(x.dtype)).float()


def _kernel_gram(stats: "MatrixStats", gram: Tensor | None, pq: Tensor | None) -> Tensor:
    """The Gram matrix of the input the kernel sees: ``gram`` (every routed token) scaled by ``pq`` on
    both sides, or, without one, the sampled rows' after scaling them."""
    if gram is None:
        return gptq.gram(_scaled_input(stats.rows, pq))
    return gram.float() if pq is None else gram.float() * torch.outer(pq.float(), pq.float())


def _err(x: Tensor, w_ref: Tensor, deq: Tensor, pq: Tensor | None, y_ref: Tensor | None = None) -> float:
    """Sum over rows of ||x W^T − (x·pq) Wq^T||² (float64 sum); ``y_ref`` = x W^T when known."""
    y = linear(x.float(), w_ref) if y_ref is None else y_ref
    yq = linear(_scaled_input(x, pq), deq)
    return float((y - yq).double().pow(2).sum())


# ---------------------------------------------------------------------------------------------
# the transform: a pre-quant scale and clip values, applied before the format's own quantize


@dataclass
class Recipe:
    """How a matrix is transformed before the format quantizes it: ``pq`` [in] the stored pre-quant
    scale (model dtype; the weight's columns are divided by it), ``clip`` the amax per (row, group)
    [out, in/g] or per row [out] (model-dtype values; None = no clipping)."""

    pq: Tensor | None = None
    clip: Tensor | None = None
    codes: Tensor | None = None  # int8 [out, in] chosen by error feedback (None: round to nearest)
    base_clip: Tensor | None = None  # with codes: the clip of the recipe they were chosen on


def float_weight(fmt: QuantFormat, w: Tensor, dtype: torch.dtype, recipe: Recipe | None) -> Tensor:
    """The float weight stored for a layer the engine builder quantizes itself (per-channel W4A16 in
    TensorRT-LLM's layout), where codes cannot be stored: the transform without them, with the clip of
    the recipe they were chosen on."""
    if recipe is None:
        return w
    if recipe.codes is None:
        return transformed_weight(fmt, w, dtype, recipe)
    return transformed_weight(fmt, w, dtype, Recipe(recipe.pq, recipe.base_clip))


def transformed_weight(fmt: QuantFormat, w: Tensor, dtype: torch.dtype, recipe: Recipe) -> Tensor:
    """The model-dtype weight the format quantizes: columns divided by the pre-quant scale, then
    clamped to ±clip per (row, group) or row. (W4A8: the format divides by the pre-quant scale itself,
    so the weight is clamped in the pre-scaled domain and handed back on the original scale.)"""
    if _w4a8(fmt):
        return _w4a8_weight(fmt, w, dtype, recipe)
    wd = _in_dtype(w, dtype)
    if recipe.pq is not None:
        wd = _in_dtype(wd / recipe.pq.float(), dtype)
    if recipe.clip is not None:
        c = recipe.clip.float()
        if _grouped(fmt):
            g = fmt.group_size
            wg = wd.reshape(wd.shape[0], -1, g)
            lim = torch.minimum(wg.abs().amax(-1), c).unsqueeze(-1)
            wd = torch.maximum(torch.minimum(wg, lim), -lim).reshape(wd.shape)
        else:
            lim = torch.minimum(wd.abs().amax(-1), c).unsqueeze(-1)
            wd = torch.maximum(torch.minimum(wd, lim), -lim)
    return wd.to(dtype)


def apply(fmt: QuantFormat, w: Tensor, dtype: torch.dtype, recipe: Recipe | None, input_amax=None
          ) -> dict[str, Tensor]:
    """The packed tensors of ``w`` in ``fmt`` under ``recipe`` (None: round to nearest, bytes exactly
    ``fmt.quantize``'s). Codes in the recipe replace the rounded ones; every scale stays the one the
    format computes from the transformed weight."""
    if recipe is None or (recipe.pq is None and recipe.clip is None and recipe.codes is None):
        return fmt.quantize(w, dtype=dtype, input_amax=input_amax)
    if _w4a8(fmt):
        packed = fmt.quantize(_w4a8_weight(fmt, w, dtype, recipe), dtype=dtype, input_amax=input_amax,
                              pre_quant_scale=recipe.pq)
        if recipe.codes is not None:  # chosen against the scales quantize gives this recipe's weight
            packed["weight"] = pack_int4(recipe.codes, dim=-2).view(torch.uint8)
        return packed
    packed = fmt.quantize(transformed_weight(fmt, w, dtype, recipe), dtype=dtype)
    if recipe.codes is not None:
        packed["weight"] = _pack_codes(fmt, recipe.codes)
    if recipe.pq is not None:
        packed["prequant_scaling_factor"] = recipe.pq.to(dtype).reshape(1, -1).contiguous()
    return packed


def _pack_codes(fmt: QuantFormat, q: Tensor) -> Tensor:
    """int8 codes [out, in] packed the way ``fmt.quantize`` packs its own."""
    if _grouped(fmt):
        return pack_int4(q, dim=-2)
    return pack_int4(q.transpose(-1, -2).contiguous(), dim=-1)


def _format_scales(fmt: QuantFormat, wt: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per element [out, in] of ``wt`` (float32 holding model-dtype values): the float32 scale the
    format rounds codes against and the model-dtype scale it stores (what a code dequantizes with)."""
    out_f, in_f = wt.shape
    if _grouped(fmt):
        g = fmt.group_size
        scale = wt.reshape(out_f, in_f // g, g).abs().amax(-1) / 7.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        stored = scale.to(dtype)
        return scale.repeat_interleave(g, -1), stored.repeat_interleave(g, -1)
    scale = wt.abs().amax(-1) / 8.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return safe.unsqueeze(-1).expand(out_f, in_f), scale.to(dtype).unsqueeze(-1).expand(out_f, in_f)


def _dequant_codes(fmt: QuantFormat, wt: Tensor, q: Tensor, dtype: torch.dtype) -> Tensor:
    """What codes ``q`` with the format's scales of ``wt`` dequantize to (float32)."""
    return (q.to(dtype) * _format_scales(fmt, wt, dtype)[1]).float()


def _fake(fmt: QuantFormat, wt: Tensor, dtype: torch.dtype, clip: Tensor | None) -> Tensor:
    if _grouped(fmt):
        return _fake_group(wt, fmt.group_size, dtype, clip)
    return _fake_channel(wt, dtype, clip)


def with_codes(fmt: QuantFormat, w: Tensor, dtype: torch.dtype, stats: MatrixStats, base: Recipe | None,
               choice: int | None = None, on_choice: Callable[[int], None] | None = None) -> Recipe | None:
    """``base`` (pre-quant scale and clip; None: neither) with error-feedback codes (``gptq.codes``),
    when that lowers the output error over every routed token (the statistics' Gram matrix; the sampled
    rows when there is none, and then only with enough of them). The codes are chosen on ``base``'s
    pre-quant scale without its clip: error feedback makes up for what the clip bought round to
    nearest, and with the clip's smaller scales it does worse (measured on the trained fixtures with
    candidates (scale, clip), (scale, no clip) and (no scale, no clip): summed over every int4 matrix,
    the second's error was within 0.8 % of the best of the three, the first's 8-15 % above, the third's
    2-4 % above). One factorization and one error-feedback pass per matrix. The codes are kept only when
    their error is below ``base``'s round-to-nearest error, so the result is never worse than it on
    those tokens. ``on_choice(i)`` is told which won (-1: ``base`` without codes, 0: the codes); a
    known ``choice`` (what an earlier, identical call chose) computes only that and no errors. W4A8:
    ``_w4a8_codes``."""
    gram = stats.gram_matrix()  # stored, or rebuilt from the layer's MoE inputs
    if gram is None and stats.rows.shape[0] < MIN_ROWS_PER_INPUT * w.shape[-1]:
        return base  # too few rows to estimate the Gram matrix: the base recipe as it is
    base = base or Recipe()
    kept = None if base.pq is None and base.clip is None else base
    if choice == -1:
        return kept
    if _w4a8(fmt):
        return _w4a8_codes(fmt, w, dtype, stats, gram, base, kept, choice, on_choice)
    pq = base.pq
    wt = transformed_weight(fmt, w, dtype, Recipe(pq, None)).float()  # the scaled weight, unclipped
    qs, ds = _format_scales(fmt, wt, dtype)
    if choice == 0:
        return Recipe(pq, None, gptq.codes(wt, qs, ds, _factor(stats, gram, pq), dtype), base.clip)
    wd = _in_dtype(w, dtype)
    h = _kernel_gram(stats, gram, pq)
    if gram is not None:  # every routed token
        # Fewer routed tokens than half the inputs: the error from the rows themselves (n·in·out
        # instead of in²·out multiply-adds; the same sum up to float rounding).
        xg = stats.gram_rows(w.shape[-1] // 2)
        err = (lambda deq: _rows_err(xg, wd, deq, pq)) if xg is not None else (lambda deq: _gram_err(h, wd, deq, pq))
    else:  # the sampled rows
        x = stats.rows
        y = linear(x.float(), wd)
        err = lambda deq: _err(x, wd, deq, pq, y)  # noqa: E731
    base_err = err(_fake(fmt, wt, dtype, base.clip))  # the base: round to nearest, clipped
    q = gptq.codes(wt, qs, ds, _factor(stats, gram, pq, h), dtype)
    won = 0 if err((q.to(dtype) * ds).float()) < base_err else -1
    if on_choice is not None:
        on_choice(won)
    return kept if won < 0 else Recipe(pq, None, q, base.clip)


def _w4a8_codes(fmt: QuantFormat, w: Tensor, dtype: torch.dtype, stats: MatrixStats, gram: Tensor | None,
                base: Recipe, kept: Recipe | None, choice: int | None,
                on_choice: Callable[[int], None] | None) -> Recipe | None:
    """W4A8's error-feedback codes: the columns of ``W / pq`` rounded a 128-group at a time against the
    scales ``base`` (the searched pre-quant scale and clip) gives the format (group amax / 7 of the
    clipped weight, and its ``weight_scale_2``), with the kernel's E4M3 rounding of the dequantized
    weight in the loop (``fp_gptq.W4A8Rule``) and the error fed forward through the Gram matrix of the
    pre-scaled inputs (their FP8 rounding left out). Unlike INT4's, these keep the clip: on the clipped
    scales the codes' output error was 12 % below the searched recipe's on a synthetic 256 x 256 matrix
    with correlated inputs, on the unclipped ones 9 % above it. Kept only when the effective weight's
    output error is below ``base``'s rounded to nearest."""
    pq = base.pq
    h = _kernel_gram(stats, gram, pq)
    # The weight's scales do not depend on the input scale: any input amax gives them.
    plain = apply(fmt, w, dtype, base, input_amax=1.0)
    wt = _in_dtype(w, dtype) / (1.0 if pq is None else pq.float())
    rule = fp_gptq.W4A8Rule(plain["weight_scale"], plain["weight_scale_2"], fmt.group_size)
    damp = gptq.damping(fp_gptq.DAMP, h.shape[-1], _rows_summed(stats, gram))
    q = fp_gptq.round_columns(wt, h, rule, factor=fp_gptq.inverse_factor(h, damp))[0]
    codes = (q.to(torch.int16) - 8).to(torch.int8)
    rec = Recipe(pq, base.clip, codes, base.clip)
    if choice == 0:
        return rec
    fed = dict(plain, weight=pack_int4(codes, dim=-2).view(torch.uint8))  # what apply(rec) packs
    err = lambda packed: fp_gptq.gram_error(h, wt, fmt._dequant_f32(packed))  # noqa: E731
    won = 0 if err(fed) < err(plain) else -1
    if on_choice is not None:
        on_choice(won)
    return kept if won < 0 else rec


def _factor(stats: MatrixStats, gram: Tensor | None, pq: Tensor | None, h: Tensor | None = None) -> gptq.Factor:
    """``gptq.factor`` of the Gram matrix of the input the kernel sees (``gram``, or the sampled rows'
    when None, scaled by ``pq``; ``h`` when already formed). The last few are remembered: the formats
    of one matrix that round it with the same pre-quant scale share one (per-channel int4 and the group
    formats whose search chose no scale, or a layer's shared scale), so it is computed once for them."""
    src = gram if gram is not None else stats.rows
    for g0, pq0, f in _FACTORS:
        if g0 is src and (pq0 is None if pq is None else pq0 is not None and pq0.dtype == pq.dtype
                          and torch.equal(pq0, pq)):
            return f
    if h is None:
        h = _kernel_gram(stats, gram, pq)
    f = gptq.factor(h, gptq.damping(gptq.DAMP, h.shape[-1], _rows_summed(stats, gram)))
    _FACTORS.append((src, pq, f))
    size = lambda e: e[2].hinv.nbytes + (e[0].nbytes if e[0].dim() == 2 and e[0].shape[0] == e[0].shape[1] else 0)  # noqa: E731
    while len(_FACTORS) > 1 and (len(_FACTORS) > _FACTORS_KEPT or sum(map(size, _FACTORS)) > _FACTORS_BYTES):
        _FACTORS.pop(0)
    return f


_FACTORS: list = []  # (Gram matrix or rows, pre-quant scale, Factor), the most recent last
_FACTORS_KEPT = 4  # an expert's fc and proj, unscaled and scaled: what the next format asks again
_FACTORS_BYTES = 1 << 30  # and at most this much of factors and the Gram matrices they hold (the newest always)


def _rows_err(x: Tensor, wd: Tensor, deq: Tensor, pq: Tensor | None) -> float:
    """``_gram_err`` from the rows ``x`` [n, in] whose Gram matrix ``h`` is: ‖(x·pq) Dᵀ‖² (float64)."""
    d = (wd if pq is None else wd / pq.float()) - deq
    xs = x.double() if pq is None else x.double() * pq.double()
    return float((xs @ d.double().t()).pow(2).sum())


def _gram_err(h: Tensor, wd: Tensor, deq: Tensor, pq: Tensor | None) -> float:
    """Σ over the Gram matrix's rows of ||x W^T − (x·pq) Wq^T||² = tr(D H Dᵀ), with ``h`` the Gram of the
    scaled input x·pq and D = W / pq − Wq (float64)."""
    d = (wd if pq is None else wd / pq.float()) - deq
    d = d.double()
    return float(((d @ h.double()) * d).sum())


def _weight_stat(wd: Tensor, g: int) -> Tensor:
    """Mean over rows of |W| normalized by its group's amax, per input channel."""
    out_f, in_f = wd.shape
    wg = wd.abs().reshape(out_f, in_f // g, g)
    wg = wg / wg.amax(-1, keepdim=True).clamp_min(1e-12)
    return wg.reshape(out_f, in_f).mean(0)


def _scale_candidates(act: Tensor, wstat: Tensor, dtype: torch.dtype) -> list[Tensor | None]:
    """None (no scale) first, then one stored pre-quant scale per grid point."""
    out: list[Tensor | None] = [None]
    act = act.float().clamp_min(1e-6)
    wstat = wstat.float().clamp_min(1e-6)
    for a in ALPHA_GRID:
        s = act.pow(a) / wstat.pow(1.0 - a)
        s = s / math.sqrt(float(s.max()) * float(s.min()))
        pq = (1.0 / s).to(dtype)
        if not bool(torch.isfinite(pq.float()).all()) or bool((pq.float() <= 0).any()):
            continue
        out.append(pq)
    return out


def search_prequant(fmt: QuantFormat, ws: list[Tensor], stats: list[MatrixStats], dtype: torch.dtype
                    ) -> Tensor | None:
    """The pre-quant scale (model dtype, [in]) shared by the matrices ``ws`` that minimizes their summed
    routed-token output error under round-to-nearest (None when no scale does better than none). Each
    matrix's error on its sample rows counts for all the tokens routed to it (count / rows), so the sum
    estimates the layer's error over every routed token."""
    g = fmt.group_size
    wds = [_in_dtype(w, dtype) for w in ws]
    n = sum(s.count for s in stats)
    act = sum(s.act_mean.double() * max(s.count, 1) for s in stats) / max(n, len(stats))
    wstat = sum(_weight_stat(wd, g) for wd in wds) / len(wds)
    y_refs = [linear(s.rows.float(), wd) for wd, s in zip(wds, stats)]
    weights = [max(s.count, 1) / max(s.rows.shape[0], 1) if len(stats) > 1 else 1.0 for s in stats]
    best, best_err = None, None
    for pq in _scale_candidates(act, wstat, dtype):
        err = 0.0
        for wd, s, y, c in zip(wds, stats, y_refs, weights):
            wt = wd if pq is None else _in_dtype(wd / pq.float(), dtype)
            err += c * _err(s.rows, wd, _fake_group(wt, g, dtype), pq, y)
        if best_err is None or err < best_err:
            best, best_err = pq, err
    return best


def _coarse(n: int) -> list[int]:
    """The coarse points of an ``n``-point grid: every ``GRID_STEP``-th and the last."""
    return sorted(set(range(0, n, GRID_STEP)) | {n - 1})


def _refined(grid: tuple[float, ...], evaluate: "Callable[[float | Tensor], tuple[Tensor, Tensor]]") -> Tensor:
    """Per element, the value of the grid point whose error is smallest, searched coarse to fine:
    ``evaluate(r)`` (``r`` a grid value, or a tensor of them per element) gives the error per element
    and the value chosen with ``r``; every ``GRID_STEP``-th point and the last, then each element's two
    neighbours of its best."""
    best_err = best_val = best_i = None
    for i in _coarse(len(grid)):
        e, v = evaluate(grid[i])
        if best_err is None:
            best_err, best_val, best_i = e, v, torch.full(e.shape, i, dtype=torch.long, device=e.device)
            continue
        better = e < best_err
        best_err, best_val = torch.where(better, e, best_err), torch.where(better, v, best_val)
        best_i = torch.where(better, i, best_i)
    values = torch.tensor(grid, dtype=torch.float32, device=best_i.device)
    for step in (-1, 1):
        j = best_i + step
        inside = (j >= 0) & (j < len(grid))
        e, v = evaluate(values[j.clamp(0, len(grid) - 1)])
        better = inside & (e < best_err)
        best_err, best_val = torch.where(better, e, best_err), torch.where(better, v, best_val)
    return best_val


def _clip_group(wt: Tensor, wd: Tensor, x: Tensor, pq: Tensor | None, g: int, dtype: torch.dtype) -> Tensor | None:
    """Per (row, group) clip of ``wt`` (the scaled weight) minimizing each group's share of the output
    error on rows ``x`` (``CLIP_GRID`` coarse to fine); None when the result is not better overall than no
    clipping."""
    xs = _scaled_input(x, pq)  # [n, in]
    out_f, in_f = wt.shape
    G = in_f // g
    xg = xs.reshape(-1, G, g)
    # Each group's error d Xᵀ X dᵀ: through the group's g × g Gram matrix, or, with fewer rows than
    # the group has inputs, through the rows themselves (n·g instead of g² multiply-adds per weight).
    few = xg.shape[0] < g
    if few:
        xg = xg.permute(1, 0, 2).contiguous()  # [G, n, g]
    else:
        gram = torch.einsum("ngk,ngl->gkl", xg, xg)  # [G, g, g]
    amax = wt.reshape(out_f, G, g).abs().amax(-1)

    def evaluate(r: "float | Tensor") -> tuple[Tensor, Tensor]:
        clip = _in_dtype(amax * r, dtype)
        d = (wt - _fake_group(wt, g, dtype, clip, amax)).reshape(out_f, G, g)
        if few:
            return torch.bmm(xg, d.permute(1, 2, 0)).pow_(2).sum(1).t(), clip  # [G, n, out] -> [out, G]
        return torch.einsum("ogk,gkl,ogl->og", d, gram, d), clip

    best_clip = _refined(CLIP_GRID, evaluate)
    if bool((best_clip >= amax).all()):
        return None
    y = linear(x.float(), wd)
    base = _err(x, wd, _fake_group(wt, g, dtype), pq, y)
    clipped = _err(x, wd, _fake_group(wt, g, dtype, best_clip), pq, y)
    return best_clip if clipped < base else None


def _clip_channel(wd: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor | None:
    """Per-row clip of a per-channel int4 matrix minimizing its row's output error on rows ``x``
    (exact: one scale per row; ``CLIP_GRID`` coarse to fine); None when no row gains."""
    xs = x.float()
    amax = wd.abs().amax(-1)

    def evaluate(r: "float | Tensor") -> tuple[Tensor, Tensor]:
        clip = _in_dtype(amax * r, dtype)
        return linear(xs, wd - _fake_channel(wd, dtype, clip)).double().pow(2).sum(0), clip  # [out]

    best_clip = _refined(CLIP_GRID, evaluate)
    return None if bool((best_clip >= amax).all()) else best_clip


def recipe_for(fmt: QuantFormat, w: Tensor, dtype: torch.dtype, stats: MatrixStats | None,
               pq: Tensor | None | str = "search", rounding: str = "awq",
               keep: "tuple[RecipeStore, int, int, str] | None" = None, input_amax=None) -> Recipe | None:
    """The transform of one matrix ``w`` [out, in] under ``rounding`` (None: round to nearest). ``pq``
    "search" searches this matrix's own pre-quant scale; a tensor (or None) imposes a shared one.
    ``keep`` = (store, layer, expert, mod): the searched scale and clip of a whole matrix with its own
    scale are kept there (calibration), or taken from there when stored for this weight.
    ``input_amax`` (per input channel, the layer's): what W4A8's static input scale is made from."""
    if stats is None or not applies(fmt) or stats.rows.shape[0] == 0:
        return None
    if stats.rows.shape[-1] != w.shape[-1]:
        raise InputError(f"activation statistics have {stats.rows.shape[-1]} input channels, the matrix "
                         f"{w.shape[-1]}", hint="recalibrate this model")
    if rounding == "gptq":
        return with_codes(fmt, w, dtype, stats, None)
    if keep is not None and isinstance(pq, str):
        store, layer, expert, mod = keep
        inter = w.shape[0] // 2 if mod == "fc" else w.shape[-1]  # the whole matrix: shard 0 of 1
        rid = recipe_id(fmt.name, expert, mod, (0, inter), False, dtype)
        base, choice = _stored_or_searched(store, layer, rid, weight_fingerprint(w, dtype),
                                           lambda: _awq_recipe(fmt, w, dtype, stats, pq, input_amax), tuple(w.shape),
                                           lambda dt: weight_fingerprint(w, dt))
        if rounding != "awq_gptq":
            return base
        return _codes_for(fmt, w, dtype, stats, base, store, layer, rid, choice)
    base = _awq_recipe(fmt, w, dtype, stats, pq, input_amax)
    if rounding != "awq_gptq":
        return base
    return with_codes(fmt, w, dtype, stats, base)


def weight_fingerprint(w: Tensor, dtype: torch.dtype) -> str:
    """Identifies the values a search sees (``w`` in the model dtype): what a stored recipe is keyed by."""
    return _fingerprint(w.detach().to(dtype))


def _fits(got: tuple, shape: tuple[int, ...]) -> bool:
    """Whether a stored (pq, clip, choice) can be applied to a matrix of ``shape`` [out, in]: a pre-quant
    scale of ``in`` positive finite values, a clip of ``out`` rows (per row or per group) of them."""
    pq, clip, _ = got
    if pq is not None and (pq.dim() != 1 or pq.numel() != shape[-1]):
        return False
    if clip is not None and (clip.dim() not in (1, 2) or clip.shape[0] != shape[0]):
        return False
    return all(t is None or bool(torch.isfinite(t.float()).all() and (t > 0).all()) for t in (pq, clip))


def _stored_or_searched(store: "RecipeStore | None", layer: int, rid: str, fp: str,
                        search: Callable[[], "Recipe | None"], shape: tuple[int, ...],
                        fingerprint_in: "Callable[[torch.dtype], str] | None" = None
                        ) -> "tuple[Recipe | None, int | None]":
    """The base recipe (scale and clip) stored for ``rid`` on this weight (of ``shape``), with the
    error-feedback choice stored with it (None: not known), or ``search()``'s, kept in ``store`` when
    it records (calibration). A stored entry that does not fit the matrix is searched again.

    ``fingerprint_in(dtype)`` (the fingerprint of the same weight(s) in another model dtype) makes a
    recording store also keep the search's result under the names and fingerprints it has in the
    other ``carried_dtypes``, its values rounded into each (``RecipeStore.keep``'s aliases): a
    checkpoint written in another dtype than the calibration computed in (a float32 calibration, a
    bfloat16 checkpoint of the same weights) takes the calibration's transform and error-feedback
    choice instead of searching again. The searches pick a transform by the output error in the dtype
    they ran in; the transform is a set of values any of these dtypes holds, and the codes are chosen
    again (``with_codes``) in the dtype the checkpoint stores."""
    got = store.get(layer, rid, fp) if store is not None else None
    if got is not None and not _fits(got, shape):
        log.warning("stored int4 recipe %s of layer %d does not fit its %s matrix: searched again",
                    rid, layer, "x".join(map(str, shape)))
        got = None
    if got is not None:
        pq, clip, choice = got
        return (None if pq is None and clip is None else Recipe(pq, clip)), choice
    rec = search()
    if store is not None and store.out_dir is not None:
        head, own = rid.rsplit("|", 1)
        aliases = [] if fingerprint_in is None else [
            (f"{head}|{dt}", fingerprint_in(dt), dt) for dt in carried_dtypes if str(dt) != own]
        store.keep(layer, rid, fp, rec.pq if rec is not None else None, rec.clip if rec is not None else None,
                   aliases)
    return rec, None


# Model dtypes a calibration's recipes are also kept for (see _stored_or_searched).
carried_dtypes = (torch.float32, torch.bfloat16, torch.float16)


def _codes_for(fmt, w, dtype, stats, base, store, layer, rid, choice):
    """``with_codes`` given what the store knows: a stored choice computes only the winner; otherwise
    the winner is kept in a recording store."""
    record = None
    if choice is None and store is not None and store.out_dir is not None:
        record = lambda i: store.keep_choice(layer, rid, i)  # noqa: E731
    return with_codes(fmt, w, dtype, stats, base, choice=choice, on_choice=record)


def _awq_recipe(fmt: QuantFormat, w: Tensor, dtype: torch.dtype, stats: MatrixStats,
                pq: Tensor | None | str, input_amax=None) -> Recipe | None:
    if _w4a8(fmt):
        return w4a8_recipe(fmt, w, stats.rows, dtype=dtype, input_amax=input_amax,
                           pre_quant_scale=None if isinstance(pq, str) else pq, search_scale=isinstance(pq, str))
    wd = _in_dtype(w, dtype)
    if not _grouped(fmt):
        clip = _clip_channel(wd, stats.rows, dtype)
        return None if clip is None else Recipe(None, clip)
    if isinstance(pq, str):
        pq = search_prequant(fmt, [w], [stats], dtype)
    wt = wd if pq is None else _in_dtype(wd / pq.float(), dtype)
    clip = _clip_group(wt, wd, stats.rows, pq, fmt.group_size, dtype)
    if pq is None and clip is None:
        return None
    return Recipe(pq, clip)


def quantize(fmt: QuantFormat, w: Tensor, *, dtype: torch.dtype, stats: MatrixStats | None,
             rounding: str = "awq", keep: "tuple[RecipeStore, int, int, str] | None" = None,
             input_amax=None) -> dict[str, Tensor]:
    """``fmt.quantize`` with ``rounding`` ("rtn": exactly ``fmt.quantize``; "awq": this matrix's own
    activation-aware transform, when it is an int4 format and statistics are given); ``keep`` as for
    ``recipe_for``."""
    if rounding not in ROUNDINGS:
        raise InputError(f"unknown rounding {rounding!r}", hint=ROUNDING_HINT)
    if rounding != "rtn" and stats is not None and fp_gptq.applies(fmt):
        return fp_quantize(fmt, w, dtype=dtype, stats=stats, rounding=rounding, input_amax=input_amax)
    if rounding == "rtn" or not applies(fmt):
        return fmt.quantize(w, dtype=dtype, input_amax=input_amax)
    rec = recipe_for(fmt, w, dtype, stats, rounding=rounding, keep=keep, input_amax=input_amax)
    return apply(fmt, w, dtype, rec, input_amax=input_amax)


def fp_quantize(fmt: QuantFormat, w: Tensor, *, dtype: torch.dtype, stats: MatrixStats, rounding: str,
                input_amax=None, weight_amax=None) -> dict[str, Tensor]:
    """A float format (FP8, FP8-block, NVFP4, MXFP4) under ``rounding`` (``trtmoe.quant.fp_gptq``):
    error-feedback codes under gptq / awq_gptq, the block-scale search under awq / awq_gptq, against
    the statistics' Gram matrix (the sampled rows' when none is kept, given enough of them); round to
    nearest when there is neither."""
    g = stats.gram_matrix()
    h = fp_gptq.stats_gram(g, lambda: stats.rows, w.shape[-1], MIN_ROWS_PER_INPUT)
    if h is None:
        return fmt.quantize(w, dtype=dtype, input_amax=input_amax, weight_amax=weight_amax)
    return fp_gptq.quantize(fmt, w, h, dtype=dtype, input_amax=input_amax, weight_amax=weight_amax,
                            feedback=rounding in ERROR_FEEDBACK, search=rounding in ("awq", "awq_gptq"),
                            rows=_rows_summed(stats, g))


def _rows_summed(stats: MatrixStats, gram: Tensor | None) -> int:
    """How many rows the Gram matrix error feedback rounds against sums: ``gram``'s (every routed token,
    or the layer's), or the sampled rows' where there is none."""
    return stats.gram_count() if gram is not None else stats.rows.shape[0]


def output_error(fmt: QuantFormat, packed: dict[str, Tensor], w: Tensor, x: Tensor, dtype: torch.dtype) -> float:
    """Mean over rows of ||x W^T − fmt.linear(x, packed)||², from the packed bytes (the engine's path)."""
    y = x.float() @ _in_dtype(w, dtype).t()
    yq = fmt.linear(x, packed).float()
    return float((y - yq).double().pow(2).sum(-1).mean())


# ---------------------------------------------------------------------------------------------
# what the checkpoint layout asks


class CheckpointRounding:
    """Activation-aware transforms for the matrices a checkpoint writes, searched once and cached.

    ``shared=True`` (TensorRT-LLM's stacked layout): one pre-quant scale per MoE layer and matrix
    kind, searched on every expert of the layer; otherwise one per expert matrix. Pre-quant scales are
    searched on whole matrices (moe_tp-independent; a ``proj`` shard gets its slice, ``fc`` shards the
    whole scale, as TensorRT-LLM shards the tensor), clips on the shard each rank stores.

    ``device``: where the searches compute (``convert --device``): each matrix, its statistics and its
    layer's weights for a shared scale go there for the search, and what is kept (transforms, codes,
    the recipe store's entries) comes back to the host. On a CUDA device the candidates that share a
    factorization are rounded as one stack. ``cpu`` itself computes in place, exactly as without a
    device (any other device, an indexed CPU one included, takes the moving path)."""

    def __init__(self, stats: ActivationStats, dtype: torch.dtype, key: tuple = (), rounding: str = "awq",
                 input_amax: dict | None = None, device: torch.device | str = "cpu"):
        self.stats, self.dtype, self.key, self.rounding = stats, dtype, key, rounding
        # Per MoE layer and matrix kind, the calibrated input amax (per input channel, or one value) that
        # the W4A8 formats' static input scales are made from: their searches measure with it.
        self.input_amax = {str(l): d for l, d in (input_amax or {}).items()}
        self.device = torch.device(device)
        self._pq: dict = {}
        self._recipes: dict = {}
        self._layer = None
        self._matrix = None  # the last matrix(e, m) given, for the layer being written
        # How each int4 matrix (shard) got its transform: "stored" (calibration's recipe, winning
        # error-feedback candidate included), "searched" (here), "reused" (this process had already
        # found it: another rank holding the same shard, or an earlier checkpoint of a benchmark).
        self.counts: dict[str, int] = {"stored": 0, "searched": 0, "reused": 0}

    def _evict(self, layer: int) -> None:
        if layer != self._layer:
            self._pq.clear()
            self._recipes.clear()
            self._layer = layer
            self._matrix = None

    def _stats(self, layer: int, expert: int, mod: str, matrix=None) -> MatrixStats:
        """Expert ``expert``'s statistics, given ``matrix(e, m)`` (the whole float matrix ``m`` of expert
        ``e``) for a ``proj`` whose inputs are rebuilt from the stored MoE inputs through ``fc``."""
        s = self.stats.get(layer, expert, mod)
        if s is None:
            raise InputError(f"the calibration's activation statistics lack layer {layer} expert {expert} {mod}",
                             hint="recalibrate this model, or convert with --rounding rtn")
        matrix = matrix or self._matrix
        return s if matrix is None else s.with_fc(lambda: matrix(expert, "fc"))

    def recipe(self, fmt: QuantFormat, layer: int, expert: int, mod: str, shard: tuple[int, int],
               w: Tensor, full, experts: list[int] | None = None, matrix=None) -> Recipe | None:
        """The transform of original expert ``expert``'s ``mod`` shard ``w``; ``shard`` = (t, I_loc)
        (moe_tp rank and per-rank FFN size); ``full(e)`` returns expert ``e``'s whole matrix;
        ``experts`` (all of the layer's) makes the pre-quant scale shared by them; ``matrix(e, m)``
        returns expert ``e``'s whole matrix ``m`` (a ``proj`` Gram matrix rebuilt from the stored MoE
        inputs needs ``fc``)."""
        if not applies(fmt):
            return None
        self._evict(layer)
        if matrix is not None:
            self._matrix = matrix
        shared = experts is not None
        key = (fmt.name, expert, mod, shard, shared)
        if key in self._recipes:
            return self._recipes[key]
        # The same matrix under the same statistics gets the same transform: remembered across
        # checkpoints written by one process (a benchmark writes many), keyed by the weight's bytes.
        fp = weight_fingerprint(w, self.dtype)
        gkey = (self.key, self.rounding, self.dtype, layer, *key, fp)
        if gkey in _RECIPES:
            self.counts["reused"] += 1
            self._recipes[key] = _RECIPES[gkey]
            return _RECIPES[gkey]
        t, I_loc = shard
        st = self._stats(layer, expert, mod, matrix)
        if mod == "proj":
            st = st.columns(t * I_loc, (t + 1) * I_loc)
        dev, host = self.device, self.device == torch.device("cpu")
        if not host:
            st, w_host, w = st.on(dev), w, w.to(dev)
        wd = _in_dtype(w, self.dtype)

        def search() -> Recipe | None:
            if _w4a8(fmt):  # the pre-quant scale per expert matrix, or the layer's shared one
                amax = self._amax(layer, mod, t, I_loc)
                amax = amax if amax is None or host else amax.to(dev)
                if not shared:
                    rec = w4a8_recipe(fmt, w, st.rows, dtype=self.dtype, input_amax=amax)
                else:
                    pq = self._prequant(fmt, layer, mod, full, experts, True)
                    if pq is not None and mod == "proj":
                        pq = pq[t * I_loc:(t + 1) * I_loc]
                    pq = pq if pq is None or host else pq.to(dev)
                    rec = w4a8_recipe(fmt, w, st.rows, dtype=self.dtype, input_amax=amax, pre_quant_scale=pq,
                                      search_scale=False)
                return None if rec is None else _moved(rec, "cpu")
            if not _grouped(fmt):
                clip = _clip_channel(wd, st.rows, self.dtype)
                return None if clip is None else _moved(Recipe(None, clip), "cpu")
            pq = self._prequant(fmt, layer, mod, full, experts if shared else [expert], shared)
            if pq is not None and mod == "proj":
                pq = pq[t * I_loc:(t + 1) * I_loc]
            pq = pq if pq is None or host else pq.to(dev)
            wt = wd if pq is None else _in_dtype(wd / pq.float(), self.dtype)
            clip = _clip_group(wt, wd, st.rows, pq, fmt.group_size, self.dtype)
            return None if pq is None and clip is None else _moved(Recipe(pq, clip), "cpu")

        rid = recipe_id(fmt.name, expert, mod, shard, shared, self.dtype)
        store = self.stats.recipes
        if self.rounding == "gptq":  # error feedback on round-to-nearest's scales: nothing searched
            rec = _moved(with_codes(fmt, w, self.dtype, st, None), "cpu")
        else:
            searched = []
            fp_in = (lambda dt: weight_fingerprint(w, dt)) if host else (lambda dt: weight_fingerprint(w_host, dt))
            rec, choice = _stored_or_searched(store, layer, rid, fp, lambda: searched.append(1) or search(),
                                              tuple(w.shape), fp_in)
            if self.rounding in ERROR_FEEDBACK:
                searched += [1] if choice is None else []
                rec = _codes_for(fmt, w, self.dtype, st, rec if host else _moved(rec, dev), store, layer, rid,
                                 choice)
                rec = rec if host else _moved(rec, "cpu")
            self.counts["searched" if searched else "stored"] += 1
        self._recipes[key] = rec
        if len(_RECIPES) >= _MAX_REMEMBERED:
            _RECIPES.pop(next(iter(_RECIPES)))
        _RECIPES[gkey] = rec
        return rec

    def _amax(self, layer: int, mod: str, t: int, I_loc: int) -> Tensor | None:
        """Layer ``layer``'s calibrated ``mod`` input amax for shard ``t`` (per channel when known)."""
        got = (self.input_amax.get(str(layer)) or {}).get(mod)
        if got is None:
            return None
        a = torch.as_tensor(got, dtype=torch.float32).reshape(-1)
        return a[t * I_loc:(t + 1) * I_loc] if mod == "proj" and a.numel() > 1 and a.numel() != I_loc else a

    def fp_quantize(self, fmt: QuantFormat, layer: int, expert: int, mod: str, shard: tuple[int, int], w: Tensor,
                    input_amax=None, matrix=None) -> dict[str, Tensor]:
        """Original expert ``expert``'s ``mod`` shard ``w`` in a float format (FP8, FP8-block, NVFP4,
        MXFP4) under the rounding (``fp_quantize``), from that expert's statistics; ``shard`` and
        ``matrix`` as for ``recipe``."""
        self._evict(layer)
        if matrix is not None:
            self._matrix = matrix
        st = self._stats(layer, expert, mod, matrix)
        t, I_loc = shard
        if mod == "proj":
            st = st.columns(t * I_loc, (t + 1) * I_loc)
        return fp_quantize(fmt, w, dtype=self.dtype, stats=st, rounding=self.rounding, input_amax=input_amax)

    def _prequant(self, fmt: QuantFormat, layer: int, mod: str, full, who: list[int], shared: bool) -> Tensor | None:
        """The searched pre-quant scale of ``who``'s ``mod`` (one expert, or the whole layer when
        ``shared``); None under plain error-feedback rounding, which has none."""
        if self.rounding == "gptq":
            return None
        pkey = (fmt.name, mod, "layer" if shared else who[0])
        if pkey not in self._pq:
            ws = [full(e) for e in who]
            if self.device == torch.device("cpu"):
                search = lambda: search_prequant(fmt, ws, [self._stats(layer, e, mod) for e in who], self.dtype)  # noqa: E731
            else:  # on the device, the scale kept on the host
                def search():
                    pq = search_prequant(fmt, [w.to(self.device) for w in ws],
                                         [self._stats(layer, e, mod).on(self.device, gram=False) for e in who],
                                         self.dtype)
                    return None if pq is None else pq.cpu()
            if shared:  # stored under the fingerprints of every expert's matrix, in order
                fp = _fingerprint_of([weight_fingerprint(w, self.dtype) for w in ws])
                rec, _ = _stored_or_searched(self.stats.recipes, layer, prequant_id(fmt.name, mod, self.dtype), fp,
                                             lambda: (lambda pq: None if pq is None else Recipe(pq))(search()),
                                             tuple(ws[0].shape),
                                             lambda dt: _fingerprint_of([weight_fingerprint(w, dt) for w in ws]))
                self._pq[pkey] = None if rec is None else rec.pq
            else:
                self._pq[pkey] = search()
        return self._pq[pkey]

    def shared_prequant(self, fmt: QuantFormat, layer: int, mod: str, shard: tuple[int, int], full,
                        experts: list[int], matrix=None) -> Tensor:
        """The layer's shared [1, in] pre-quant scale tensor for the stacked layout (ones when none);
        ``matrix`` as for ``recipe``."""
        self._evict(layer)
        if matrix is not None:
            self._matrix = matrix
        pq = self._prequant(fmt, layer, mod, full, experts, True)
        t, I_loc = shard
        in_f = full(experts[0]).shape[-1] if mod == "fc" else I_loc
        if pq is None:
            return torch.ones(1, in_f, dtype=self.dtype)
        if mod == "proj":
            pq = pq[t * I_loc:(t + 1) * I_loc]
        return pq.to(self.dtype).reshape(1, -1).contiguous()


_LOADED: dict = {}
_RECIPES: dict = {}
_MAX_REMEMBERED = 8192


def _moved(rec: Recipe | None, device: torch.device | str) -> Recipe | None:
    """``rec`` with its tensors on ``device``."""
    if rec is None:
        return None
    return Recipe(*(None if t is None else t.to(device) for t in (rec.pq, rec.clip, rec.codes, rec.base_clip)))


def _fingerprint(w: Tensor) -> str:
    import hashlib

    t = w.detach().contiguous().cpu()
    return hashlib.sha1(t.view(torch.uint8).reshape(-1).numpy().tobytes()).hexdigest() + str(tuple(t.shape))


def _fingerprint_of(parts: list[str]) -> str:
    import hashlib

    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def rounding_for_plan(plan, dtype: torch.dtype, device: torch.device | str = "cpu") -> CheckpointRounding | None:
    """The checkpoint rounding a plan asks for (``plan.meta["rounding"]`` other than "rtn", with
    ``plan.meta["activations"]["path"]``), or None for round-to-nearest; its searches run on
    ``device``."""
    meta = getattr(plan, "meta", None) or {}
    rounding = meta.get("rounding", "rtn")
    if rounding == "rtn":
        return None
    if rounding not in ROUNDINGS:
        raise InputError(f"unknown rounding {rounding!r} in the plan", hint=ROUNDING_HINT)
    act = meta.get("activations") or {}
    path = act.get("path")
    if not path:
        raise InputError(f"{rounding} rounding needs the calibration's activation statistics",
                         hint="convert with --calib CALIB (from `trtmoe calibrate`) or --rounding rtn")
    p = Path(path)
    if not p.is_file():
        raise InputError("activation statistics are missing", where=str(p),
                         hint="recalibrate, or convert with --rounding rtn")
    key = (str(p.resolve()), act.get("sha256"), p.stat().st_mtime_ns)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = ActivationStats.load(p)
    _LOADED[key].check_inputs()
    return CheckpointRounding(_LOADED[key], dtype, key, rounding, meta.get("input_amax"), device=device)


STALE_FLOAT_NOTE = ("this calibration measured the float formats (FP8, FP8-block, NVFP4, MXFP4) rounded to "
                    "nearest (it predates their activation-aware codes): they are written with {} codes, better "
                    "than its predicted ΔKL; recalibrate for predictions that match")


def has_float_rounding(formats) -> bool:
    """Whether any of the format names is a float format ``fp_gptq`` rounds (FP8, FP8-block, NVFP4, MXFP4)."""
    return any(f in FORMATS and fp_gptq.applies(FORMATS[f]) for f in formats)


STALE_W4A8_NOTE = ("this calibration measured W4A8-AWQ with its searched pre-quant scale and clip rounded to "
                   "nearest (it predates W4A8's error-feedback codes): it is written with {} codes, better than "
                   "its predicted ΔKL; recalibrate for predictions that match")


def has_w4a8(formats) -> bool:
    """Whether any of the format names is W4A8-AWQ (error-feedback codes under gptq / awq_gptq)."""
    return any(f in FORMATS and _w4a8(FORMATS[f]) for f in formats)


def stale_w4a8_codes(calib: dict | None) -> bool:
    """True for a calibration with error-feedback rounding whose W4A8 candidates were measured without
    codes: one made before calib.json recorded ``w4a8_rounding``."""
    if not calib or calib.get("rounding", "rtn") not in ERROR_FEEDBACK or "w4a8_rounding" in calib:
        return False
    return has_w4a8(calib.get("formats", ()))


def stale_float_rounding(calib: dict | None) -> bool:
    """True for a calibration whose rounding is activation-aware but which measured its float formats rounded
    to nearest: one made before calib.json recorded ``float_rounding``."""
    if not calib or calib.get("rounding", "rtn") == "rtn" or "float_rounding" in calib:
        return False
    return has_float_rounding(calib.get("formats", ()))


def attach(plan, rounding: str, calib_dir: str | Path | None, calib: dict | None = None, *,
           asked: bool = True):
    """``plan`` with ``rounding`` recorded in its meta (what the layout reads and the manifest keeps):
    a new plan, the given one is left as it is. Every rounding but rtn needs a calibration with
    activation statistics: a calibration without them, or a rounding ``asked`` for by name without a
    calibration, is refused; only the default rounding (``asked`` False) of a plan with no calibration
    at all falls back to round-to-nearest, and says so. A plan that stores neither an int4 format nor
    a float one ``fp_gptq`` rounds (FP8, FP8-block, NVFP4, MXFP4) comes back unchanged."""
    if rounding not in ROUNDINGS:
        raise InputError(f"unknown rounding {rounding!r}", hint=ROUNDING_HINT)
    if plan is None or not any(f in FORMATS and (applies(FORMATS[f]) or fp_gptq.applies(FORMATS[f]))
                               for f in plan.used_formats()):
        return plan
    meta = {**plan.meta, "notes": list(plan.meta.get("notes") or [])}

    def note(text: str) -> None:
        meta["rounding_note"] = text
        meta["notes"].append(text)

    measured = (calib or {}).get("rounding")
    act = None
    if rounding != "rtn" and calib_dir is not None:
        d = Path(calib_dir)
        f = (d if d.is_dir() else d.parent) / ACT_FILE
        if not f.is_file():
            raise InputError(f"{rounding} rounding needs the calibration's activation statistics, which are "
                             "missing", where=str(f),
                             hint=f"recalibrate (`trtmoe calibrate ... --rounding {rounding}`), or convert with "
                                  "--rounding rtn")
        act = f
    if rounding != "rtn" and act is None and asked:
        raise InputError(f"--rounding {rounding} needs a calibration with activation statistics",
                         hint="pass --calib CALIB (from `trtmoe calibrate`), or use --rounding rtn")
    if rounding != "rtn" and act is None:
        note(f"{rounding} needs a calibration with activation statistics (--calib from `trtmoe calibrate`); "
             "int4 weights rounded to nearest")
        rounding = "rtn"
    elif measured is not None and measured != rounding:
        note(f"sensitivities were measured with {measured} rounding, the int4 weights use {rounding}")
    if rounding != "rtn" and stale_float_rounding(calib) and has_float_rounding(plan.used_formats()):
        note(STALE_FLOAT_NOTE.format(rounding))
    if rounding in ERROR_FEEDBACK and stale_w4a8_codes(calib) and has_w4a8(plan.used_formats()):
        note(STALE_W4A8_NOTE.format(rounding))
    if not meta["notes"] and "notes" not in plan.meta:
        del meta["notes"]
    meta["rounding"] = rounding
    if act is not None:
        meta["activations"] = {"path": str(act.resolve()), "sha256": sha256_file(act)}
    return replace(plan, meta=meta)


# ---- activation-aware search for INT4 weights under FP8 activations (W4A8 AWQ) --------------------
# The recipe (``Recipe(pq, clip)``) of a W4A8 matrix: ``pq`` [in] the stored ``pre_quant_scale`` (the
# inputs are multiplied by it, the weight's columns divided by it: None = ones), ``clip`` [out, in/128]
# the amax of each (row, group) of the pre-scaled weight ``W / pq`` (model-dtype values; None: none).
# TensorRT-LLM's W4A8 fused MoE (WInt4AFP8FusedMoEMethod, ModelOpt "vanilla" checkpoints) reads a
# pre_quant_scale per expert for w1, w3 and w2 and runs w1 and w3 as one GEMM on the elementwise max
# of their two scales, so the two must carry the same one: trtmoe searches ``fc`` = [up; gate] as one
# matrix, which gives exactly that. Its DeepEP low-latency dispatch wants one scale per layer instead
# (not produced here).
W4A8_ALPHAS = 20
W4A8_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
W4A8_MAX_ROWS = 1024


def w4a8_output_error(fmt: QuantFormat, packed: dict[str, Tensor], x: Tensor, y_ref: Tensor) -> float:
    """Mean squared error of the kernel's output (``fmt.linear``: pre-quant scale, FP8 inputs under the
    static input scale, the INT4-then-FP8 weight) against the float product ``y_ref``."""
    return float((fmt.linear(x, packed) - y_ref).pow(2).mean())


def _w4a8_clip(fmt: QuantFormat, wt: Tensor, xq: Tensor, ratios, dtype: torch.dtype) -> Tensor:
    """Per output row and input group, the clipped amax (a ratio of the group's amax, rounded into the
    model dtype) whose INT4 rounding gives the smallest error on that group's share of the output,
    ``xq`` being the inputs as the kernel sees them (pre-scaled, FP8-rounded)."""
    g = fmt.group_size
    out_f, in_f = wt.shape
    best = torch.empty(out_f, in_f // g)
    for gi in range(in_f // g):
        wg, xg = wt[:, gi * g:(gi + 1) * g], xq[:, gi * g:(gi + 1) * g]
        amax = wg.abs().amax(dim=1).clamp(min=1e-12)
        err_best = torch.full((out_f,), float("inf"))
        for r in ratios:
            c = _in_dtype(amax * r, dtype)
            lim = torch.minimum(c, amax).unsqueeze(1)  # what the format's group amax becomes
            s = lim / 7.0
            q = (torch.maximum(torch.minimum(wg, lim), -lim) / s).round().clamp(-8, 7) * s
            err = (xg @ (wg - q).T).pow(2).sum(0)
            better = err < err_best
            err_best = torch.where(better, err, err_best)
            best[:, gi] = torch.where(better, c, best[:, gi])
    return best


def _w4a8_weight(fmt: QuantFormat, w: Tensor, dtype: torch.dtype, recipe: Recipe | None) -> Tensor:
    """The model-dtype weight W4A8's ``quantize`` takes for ``recipe`` (it divides by the pre-quant scale
    itself): ``w`` unchanged without a clip, else ``clamp(W / pq, ±clip) * pq``."""
    if recipe is None or recipe.clip is None:
        return w.to(dtype)
    wd = _in_dtype(w, dtype)
    pq = torch.ones(wd.shape[-1]) if recipe.pq is None else recipe.pq.float()
    lim = recipe.clip.float().repeat_interleave(fmt.group_size, dim=1)
    return (torch.maximum(torch.minimum(wd / pq, lim), -lim) * pq).to(dtype)


def _w4a8_amax(input_amax, x: Tensor, in_f: int, dtype: torch.dtype) -> Tensor:
    """The per-input-channel amax the static input scale is made from (float32 [in], as the checkpoint
    writers pass it to the format): the given one (a scalar stands for every channel), or the inputs'
    own."""
    if input_amax is None:
        return x.abs().amax(dim=0).float()
    a = torch.as_tensor(input_amax, dtype=torch.float32).detach().cpu().reshape(-1)
    if a.numel() == 1:
        a = a.expand(in_f)
    if a.numel() != in_f:
        raise InputError(f"search_w4a8: input_amax must hold one value per input channel ({in_f})")
    return a


def _w4a8_search(fmt: QuantFormat, w: Tensor, x: Tensor, *, dtype: torch.dtype, input_amax=None,
                 pre_quant_scale: Tensor | None = None, search_scale: bool = True, alphas: int = W4A8_ALPHAS,
                 clip_ratios=W4A8_CLIP_RATIOS, max_rows: int = W4A8_MAX_ROWS
                 ) -> tuple[Recipe | None, dict[str, Tensor], dict]:
    """``search_w4a8``'s search; also returns the recipe (None: plain rounding) that ``apply`` turns into
    the same packed tensors. ``search_scale`` False keeps ``pre_quant_scale`` (None: ones) and searches
    the clip only."""
    if fmt.activation != "fp8" or not hasattr(fmt, "group_size") or not fmt.needs_input_amax:
        raise InputError(f"{fmt.name}: search_w4a8 needs a W4A8 format (int4 groups, FP8 inputs)")
    if w.dim() != 2 or x.dim() != 2 or x.shape[-1] != w.shape[-1]:
        raise InputError(f"search_w4a8: weight [out, in] and inputs [N, in] expected, got "
                         f"{tuple(w.shape)} and {tuple(x.shape)}")
    x = _sample(x.float(), max_rows) if x.shape[0] > max_rows else x.float()
    amax = _w4a8_amax(input_amax, x, w.shape[-1], dtype)
    y_ref = x @ _in_dtype(w, dtype).T
    pq0 = None if pre_quant_scale is None else pre_quant_scale.reshape(-1).to(dtype)
    packed = fmt.quantize(w, dtype=dtype, input_amax=amax, pre_quant_scale=pq0)
    rtn_err = err = w4a8_output_error(fmt, packed, x, y_ref)
    info = {"alpha": 0.0, "clipped": False, "rtn_error": rtn_err}
    best_pq = pq0
    act = x.abs().mean(dim=0).clamp(min=1e-8)
    for i in range(1, alphas if search_scale else 1):
        s = act.pow(i / alphas)
        s = s / (s.max() * s.min()).sqrt()
        pq = (1.0 / s).to(dtype)
        if not bool((pq.float() > 0).all()) or not bool(torch.isfinite(pq.float()).all()):
            continue
        cand = fmt.quantize(w, dtype=dtype, input_amax=amax, pre_quant_scale=pq)
        e = w4a8_output_error(fmt, cand, x, y_ref)
        if e < err:
            packed, err, best_pq, info["alpha"] = cand, e, pq, i / alphas
    clip = None
    if clip_ratios:
        pqf = packed["pre_quant_scale"].float()
        wt = _in_dtype(w, dtype) / pqf
        c = _w4a8_clip(fmt, wt, fmt.quantize_input(x, packed), clip_ratios, dtype)
        gmax = wt.reshape(wt.shape[0], -1, fmt.group_size).abs().amax(-1)
        if bool((c < gmax).any()):
            cand = apply(fmt, w, dtype, Recipe(best_pq, c), input_amax=amax)
            e = w4a8_output_error(fmt, cand, x, y_ref)
            if e < err:
                packed, err, clip, info["clipped"] = cand, e, c, True
    info["error"] = err
    recipe = None if best_pq is None and clip is None else Recipe(best_pq, clip)
    return recipe, packed, info


def w4a8_recipe(fmt: QuantFormat, w: Tensor, x: Tensor, *, dtype: torch.dtype, input_amax=None,
                pre_quant_scale: Tensor | None = None, search_scale: bool = True) -> Recipe | None:
    """The W4A8 recipe (pre-quant scale and clip) of ``w`` [out, in] searched on its inputs ``x``
    (``search_w4a8``), None when plain rounding is best; with ``search_scale`` False the given
    ``pre_quant_scale`` (a layer's shared one) is kept and only the clip is searched."""
    if x.shape[0] == 0:
        return None if pre_quant_scale is None else Recipe(pre_quant_scale.reshape(-1).to(dtype))
    rec, _, _ = _w4a8_search(fmt, w, x, dtype=dtype, input_amax=input_amax, pre_quant_scale=pre_quant_scale,
                             search_scale=search_scale)
    return rec


def search_w4a8(fmt: QuantFormat, w: Tensor, x: Tensor, *, dtype: torch.dtype, input_amax: Tensor | None = None,
                alphas: int = W4A8_ALPHAS, clip_ratios=W4A8_CLIP_RATIOS, max_rows: int = W4A8_MAX_ROWS
                ) -> tuple[dict[str, Tensor], dict]:
    """AWQ for a W4A8 matrix ``w`` ``[out, in]`` on its inputs ``x`` ``[N, in]``: the pre-quant scale
    ``pq = sqrt(max * min) / mean|x|^a`` over a grid of ``a`` (the inputs are multiplied by ``pq``, the
    weight's columns divided by it), then a clip per output row and group of the pre-scaled weight,
    each candidate measured as the kernel runs it (inputs pre-scaled, then FP8 under the input scale of
    ``input_amax``: a per-input-channel amax, so the scale follows the pre-quant scale; the inputs' own
    amax when not given). Returns the packed tensors with the smallest output error (plain rounding
    when nothing beats it) and ``{"alpha", "clipped", "rtn_error", "error"}``."""
    _, packed, info = _w4a8_search(fmt, w, x, dtype=dtype, input_amax=input_amax, alphas=alphas,
                                   clip_ratios=clip_ratios, max_rows=max_rows)
    return packed, info


def checkpoint_rounding(calib_dir: str | Path, calib: dict, dtype: torch.dtype, rounding: str | None = None
                        ) -> CheckpointRounding | None:
    """The calibration's rounding (or ``rounding``, when given) for a checkpoint written outside a plan
    (the unified-HF export): its recipes, statistics and per-channel input amax in ``dtype``; None for
    round to nearest, or when the calibration kept no activation statistics (then the export rounds to
    nearest)."""
    if rounding is None:
        rounding = calib.get("rounding", "rtn")
        if rounding not in ROUNDINGS:
            raise InputError(f"unknown rounding {rounding!r} in the calibration", hint=ROUNDING_HINT)
    elif rounding not in ROUNDINGS:
        raise InputError(f"unknown rounding {rounding!r}", hint=ROUNDING_HINT)
    d = Path(calib_dir)
    act = (d if d.is_dir() else d.parent) / ACT_FILE
    if rounding == "rtn" or not act.is_file():
        return None
    key = (str(act.resolve()), sha256_file(act), act.stat().st_mtime_ns)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = ActivationStats.load(act)
    _LOADED[key].check_inputs()
    return CheckpointRounding(_LOADED[key], dtype, key, rounding, calib.get("input_amax"))


EXPERT_ROLES = ("gate", "up", "down")  # a routed expert's linears: fc = [up; gate], proj = down


def w4a8_expert_tensors(rounding: CheckpointRounding, fmt: QuantFormat, layer: int, expert: int, role: str,
                        read: Callable[[int, str], Tensor]) -> dict[str, Tensor] | None:
    """A routed expert linear's W4A8 tensors under the calibration's recipe, in ModelOpt's names
    (``weight``, ``weight_scale``, ``weight_scale_2``, ``pre_quant_scale``, ``input_scale``); None for a
    format without the W4A8 search. ``read(e, role)`` gives expert ``e``'s ``role`` weight [out, in].

    gate and up are rounded as trtmoe's ``fc`` = [up; gate], one matrix with one recipe, and split:
    the two carry the same pre-quant scale (TensorRT-LLM's W4A8 fused MoE runs w1 and w3 on the max of
    theirs), the same ``weight_scale_2`` (the amax of the pre-scaled pair) and the same input scale."""
    if not _w4a8(fmt) or role not in EXPERT_ROLES:
        return None
    dt = rounding.dtype

    def matrix(e: int, m: str) -> Tensor:
        if m == "proj":
            return read(e, "down").to(dt)
        return torch.cat([read(e, "up").to(dt), read(e, "gate").to(dt)])

    mod = "proj" if role == "down" else "fc"
    w = matrix(expert, mod)
    inter = w.shape[-1] if mod == "proj" else w.shape[0] // 2
    rec = rounding.recipe(fmt, layer, expert, mod, (0, inter), w, lambda e: matrix(e, mod), matrix=matrix)
    amax = rounding._amax(layer, mod, 0, inter)
    packed = apply(fmt, w, dt, rec, input_amax=amax)
    if mod == "proj":
        return packed
    half = slice(0, inter) if role == "up" else slice(inter, 2 * inter)
    out = dict(packed)
    out["weight"] = packed["weight"][half.start // 2:half.stop // 2]  # rows 2j, 2j+1 share a byte
    out["weight_scale"] = packed["weight_scale"][half]
    return out
