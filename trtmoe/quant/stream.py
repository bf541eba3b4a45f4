"""Layer-streamed calibration through transformers' own modelling code (``calibrate --runner stream``).

The model is built from its config.json by transformers on the meta device (no memory), and only the
embedding, the final norm and the output head are loaded for the whole run. Each decoder layer is
loaded when it runs, from the safetensors shards (just its tensors, through transformers' own
checkpoint conversion, so the fused 3-D ``*Experts`` layout is what it computes with), and dropped
again afterwards: the weights resident at any time are one decoder layer's plus the embedding and
head, whatever the depth. Any MoE that transformers implements runs this way; the seam calibration
reads is the ``*Experts`` module every transformers 5 MoE has (``gate_up_proj`` / ``down_proj``
3-D parameters, concatenated or interleaved gate/up, transposed or not, with or without biases,
called as ``forward(hidden_states, top_k_index, top_k_weights)``).

The run, per calibration batch of ``batch_size`` sequences:

1. Boundaries: the model's own forward runs with every decoder layer replaced by a stand-in that
   records what the layer is called with (attention masks, position embeddings: each architecture's
   own) and passes the hidden states through. That gives each layer's call arguments and the
   embedding output.
2. Forward, layer by layer from the bottom: each layer's output over every batch, written to the
   workspace (``stream/x-LLL.pt``, the layer-boundary activations; one in memory at a time). The top
   gives the logits, the Fisher probe (``sensitivity._probe``, seeded per batch as the whole-model path
   seeds it) and the gradient at the final hidden state.
3. Backward, layer by layer from the top: each layer is recomputed from its stored input with the
   gradient recorded, the incoming gradient is backpropagated through it, and the MoE layer's
   ``*Experts`` module is observed on the way (its inputs, routed experts and routing weights, and the
   gradient at its output: exactly what the whole-model path records at the MoE output). The layer's
   expert matrices are then scored (``sensitivity.score_layer_tensors``) while its weights are still
   resident, and the gradient at its input is passed down.

The result equals the whole-model Fisher measurement within float rounding: the same per-token
quantities, computed by the same scoring code, from the same probe.

Resumable per layer: a rerun with the same key continues after the last boundary written (forward) or
the last layer scored (backward); scored layers restore their rounding state as the whole-model path
does.

Memory: ``memory_plan`` states what the run needs (one layer's weights in the compute dtype and their
copy as read, the embedding and head, the boundary activations, one batch's logits) before anything
is loaded, and ``calibrate`` refuses a run that does not fit in the memory available.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import os
import re
import shutil
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import InputError, TrtmoeError, UnsupportedError, raised_in
from ..hf.experts_seam import expert_input_weight
from ..hf.loaded_names import loaded_name
from ..hf.safetensors_io import SafetensorsFile
from ..runtime.alloc import give_back_freed_memory
from . import awq
from .calib_schema import build_result
from .plan import MATRICES, format_obj
from .sensitivity import (ESTIMATE_SHARE, ESTIMATE_TOKENS, PROBES, RTN, STACKED, PhaseClock, Progress, _check_layer,
                          _load, _probe, _save, _under_observed, amax_json, fisher_sensitivity,
                          score_layer_tensors)

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FLOAT_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _transformers():
    """transformers' config, model and checkpoint-conversion entry points (an optional dependency)."""
    try:
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
    except ImportError as e:  # pragma: no cover - transformers is installed wherever tests run
        raise InputError(f"the layer-streamed runner runs transformers' modelling code, which cannot be "
                         f"imported ({e})", hint="pip install 'transformers>=5,<6', or use --runner engine") from None
    return transformers, get_model_conversion_mapping, convert_and_load_state_dict_in_model, LoadStateDictConfig


# ---- the experts seam -------------------------------------------------------------------------------


class SeamExperts(torch.nn.Module):
    """Routed experts called at the seam, ``forward(hidden_states, top_k_index, top_k_weights)``, for a
    model whose own experts module takes every token for every expert (Llama-4). It holds that module's
    parameters under their own names (``gate_up_proj`` [E, H, 2I] with gate first, ``down_proj``
    [E, I, H]), so the checkpoint loads into it unchanged."""

    is_transposed = True
    is_concatenated = True

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.gate_up_proj = inner.gate_up_proj
        self.down_proj = inner.down_proj
        self.act_fn = inner.act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            rows, slot = (top_k_index == e).nonzero(as_tuple=True)
            gate, up = (hidden_states[rows] @ self.gate_up_proj[e]).chunk(2, dim=-1)
            y = (up * self.act_fn(gate)) @ self.down_proj[e]
            out.index_add_(0, rows, y * top_k_weights[rows, slot, None].to(y.dtype))
        return out


def _scaled_input_router(router: torch.nn.Module, x: torch.Tensor):
    """Llama-4's routing restated with the logits first: top-k of the logits, the chosen logits through
    a sigmoid (computed in float32, returned in the logits' dtype) as the experts' weights."""
    logits = F.linear(x, router.weight, router.bias)
    top, idx = torch.topk(logits, router.top_k, dim=1)
    return logits, torch.sigmoid(top.float()).to(logits.dtype), idx


def _scaled_input_moe(moe: torch.nn.Module, hidden_states: torch.Tensor):
    """Llama-4's MoE block at the seam: the router's weight scales the expert's *input* (one expert
    per token), so the seam receives the scaled input with unit weight; the shared expert sees the
    unscaled input. Returns what Llama-4's block returns: (output, router logits)."""
    x = hidden_states.reshape(-1, moe.hidden_dim)
    logits, w, idx = moe.router(x)
    routed = moe.experts(x * w, idx, torch.ones_like(w))
    return moe.shared_expert(x) + routed, logits


def adapt_seams(model: torch.nn.Module) -> int:
    """Give every MoE block whose experts take all tokens with router-scaled inputs (Llama-4: a ``router``
    with ``top_k`` and an experts module called with the hidden states alone) the experts seam, in place
    and with the same parameter names; returns how many blocks were adapted. Exact for one expert per
    token (Llama-4's configuration); more is refused, since each chosen expert would see another input."""
    n = 0
    for mod in list(model.modules()):
        experts, router = getattr(mod, "experts", None), getattr(mod, "router", None)
        if experts is None or router is None or isinstance(experts, SeamExperts):
            continue
        gu = getattr(experts, "gate_up_proj", None)
        params = [p for p in inspect.signature(experts.forward).parameters if p not in ("self", "args", "kwargs")]
        if not (isinstance(gu, torch.Tensor) and gu.dim() == 3 and len(params) == 1 and hasattr(router, "top_k")
                and hasattr(mod, "shared_expert") and hasattr(mod, "hidden_dim")):
            continue
        if int(router.top_k) != 1:
            raise InputError(f"{type(mod).__name__}: experts whose input is scaled by the router weight are "
                             f"calibrated with one expert per token only (this model routes {router.top_k})")
        mod.experts = SeamExperts(experts)
        router.forward = types.MethodType(_scaled_input_router, router)
        mod.forward = types.MethodType(_scaled_input_moe, mod)
        n += 1
    return n


def find_experts(layer: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module | None] | None:
    """A decoder layer's routed ``*Experts`` module (3-D ``gate_up_proj`` or, without a gate, ``up_proj``,
    and ``down_proj``) and its router (the sibling named ``gate`` or ``router``); None for a dense layer."""
    for _, mod in layer.named_modules():
        dn = getattr(mod, "down_proj", None)
        if expert_input_weight(mod)[0] is not None and isinstance(dn, torch.Tensor) and dn.dim() == 3:
            parent = next((p for _, p in layer.named_modules() if any(c is mod for c in p.children())), None)
            router = None
            if parent is not None:
                router = getattr(parent, "gate", None) or getattr(parent, "router", None)
                router = router if isinstance(router, torch.nn.Module) else None
            return mod, router
    return None


# The config fields MoE architectures name their experts per token with.
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "top_k", "top_k_experts", "moe_topk", "moe_top_k", "moe_k")
NO_SEAM = ("no routed-experts module at transformers' experts seam (a module with 3-D gate_up_proj / down_proj) in "
           "any decoder layer: experts held otherwise (per-expert modules, other names) are not read")


def no_causal_lm(config) -> str:
    """Why transformers builds no causal LM of ``config`` (its auto class has no mapping for it), in one line."""
    mt = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        why = "an encoder-decoder model"
    elif config.get_text_config() is not config:
        why = "a multimodal wrapper around its text model"
    else:
        why = "AutoModelForCausalLM has no class for it"
    return (f"transformers has no causal-LM class for model_type {mt!r} ({why}): decoder-only causal language "
            "models only")


def layers_elsewhere(model: torch.nn.Module, config) -> str:
    """Why the runner cannot read ``model``'s decoder layers at model.layers, in one line."""
    if config.get_text_config() is not config:  # a multimodal class in the causal-LM mapping (Gemma-4)
        return (f"{type(model).__name__} is a multimodal wrapper around its text model (model_type "
                f"{getattr(config.get_text_config(), 'model_type', '?')!r}), whose decoder layers the layer-streamed "
                "runner does not reach: decoder-only causal language models only")
    return (f"{type(model).__name__}: the layer-streamed runner reads the decoder layers at model.layers and the "
            "head at lm_head; this model has them elsewhere")


def experts_per_token(text_config, router: torch.nn.Module | None) -> int:
    """How many experts each token is routed to: the config's field (``TOP_K_FIELDS``), else the router
    module's own ``top_k``; 0 when neither says."""
    for name in TOP_K_FIELDS:
        k = getattr(text_config, name, None)
        if isinstance(k, int) and not isinstance(k, bool) and k > 0:
            return k
    k = getattr(router, "top_k", None) if router is not None else None
    return int(k) if isinstance(k, int) and not isinstance(k, bool) and k > 0 else 0


@dataclass
class ExpertLayout:
    """How a transformers experts module stores its matrices: ``gate_up_proj`` [E, 2I, H] (or [E, H, 2I]
    when ``transposed``) with gate and up concatenated (gate first) or interleaved, ``down_proj``
    [E, H, I] (or [E, I, H]), and optional biases."""

    transposed: bool
    concatenated: bool
    bias: bool
    standard: bool  # silu(gate)·up, no bias: the engine's own expert arithmetic

    @classmethod
    def of(cls, mod: torch.nn.Module, hidden: int) -> "ExpertLayout":
        if not getattr(mod, "has_gate", expert_input_weight(mod)[1]):
            raise InputError(f"{type(mod).__name__}: experts without a gate projection are not supported by "
                             "calibration (it scores gated experts: fc = [up; gate], proj = down)")
        gu = mod.gate_up_proj
        transposed = bool(getattr(mod, "is_transposed", gu.shape[-1] != hidden and gu.shape[1] == hidden))
        concatenated = bool(getattr(mod, "is_concatenated", True))
        bias = bool(getattr(mod, "has_bias", getattr(mod, "gate_up_proj_bias", None) is not None))
        gate_fn = getattr(type(mod), "_apply_gate", None)
        default_gate = gate_fn is None or gate_fn.__name__ == "_default_apply_gate"
        silu = type(getattr(mod, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        return cls(transposed, concatenated, bias, default_gate and silu and concatenated and not bias)


class HFExperts:
    """One MoE layer's routed experts, taken from a transformers experts module into the layout the
    engine and the quantizers use: ``fc`` [E, 2I, H] = per expert [up; gate], ``proj`` [E, H, I], with the
    fc and proj biases (``fc_bias`` [E, 2I] in the same row order, ``proj_bias`` [E, H]) and, when the
    module's gating is not silu(gate)·up, ``activation`` (the module's own gating on [up; gate]).

    The usual layout (gate and up concatenated, not transposed) is reordered in place in the module's
    own parameter, so that the layer's experts are not held twice: the module must not run afterwards."""

    def __init__(self, mod: torch.nn.Module, layout: ExpertLayout, fmt: str):
        self.fmt, self.layout, self._mod = fmt, layout, mod
        with torch.no_grad():
            gu, dn = mod.gate_up_proj.data, mod.down_proj.data
            if layout.transposed:
                gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
            if layout.concatenated and not layout.transposed:
                n = gu.shape[1] // 2
                gate = gu[:, :n].clone()
                gu[:, :n] = gu[:, n:]
                gu[:, n:] = gate
                del gate
                self.fc = gu
            else:
                self.fc = self._to_up_gate(gu, 1, layout.concatenated)
            self.proj = dn.contiguous()
            self.fc_bias = self.proj_bias = None
            if layout.bias:
                self.fc_bias = self._to_up_gate(mod.gate_up_proj_bias.detach(), 1, layout.concatenated).float()
                self.proj_bias = mod.down_proj_bias.detach().float().clone()
        if not layout.standard:
            self.activation = self._module_gate

    @staticmethod
    def _to_up_gate(t: torch.Tensor, dim: int, concatenated: bool) -> torch.Tensor:
        n = t.shape[dim] // 2
        if concatenated:
            gate, up = t.narrow(dim, 0, n), t.narrow(dim, n, n)
        else:
            idx = torch.arange(t.shape[dim], device=t.device)
            gate, up = t.index_select(dim, idx[0::2]), t.index_select(dim, idx[1::2])
        return torch.cat([up, gate], dim).contiguous()

    def _module_gate(self, hh: torch.Tensor) -> torch.Tensor:
        up, gate = hh.chunk(2, dim=-1)
        if self.layout.concatenated:
            native = torch.cat([gate, up], -1)
        else:
            native = torch.stack([gate, up], -1).flatten(-2)
        return self._mod._apply_gate(native)

    def row_major(self, e: int) -> dict[str, torch.Tensor]:
        return {"fc": self.fc[e].contiguous(), "proj": self.proj[e].contiguous()}

    def fc_out(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s [up; gate] pre-activations of ``x`` (bias included), in ``x``'s dtype."""
        hh = x @ self.fc[e].t().to(x.dtype)
        return hh if self.fc_bias is None else hh + self.fc_bias[e].to(hh.dtype)

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        hh = self.fc_out(e, x)
        if self.layout.standard:
            up, gate = hh.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = self.activation(hh)
        y = a @ self.proj[e].t()
        return y if self.proj_bias is None else y + self.proj_bias[e].to(y.dtype)

    def format_of(self, e: int) -> str:
        return self.fmt


class _CastEmbedding(torch.nn.Module):
    """The input embedding kept in the checkpoint dtype, its rows cast to the compute dtype when looked up
    (the same values as casting the whole table, without holding it twice)."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype
        self.weight = getattr(inner, "weight", None)

    def forward(self, ids):
        return self.inner(ids).to(self.dtype)


class _CastHead(torch.nn.Module):
    """The output head kept in the checkpoint dtype, applied to hidden states of another dtype ``rows``
    vocabulary rows at a time (its weight cast per block, never whole)."""

    def __init__(self, inner: torch.nn.Module, rows: int = 16384):
        super().__init__()
        self.inner, self.rows = inner, rows

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w, bias = self.inner.weight, getattr(self.inner, "bias", None)
        if w.dtype == h.dtype:
            return self.inner(h)
        out = torch.cat([h @ w[i:i + self.rows].to(h.dtype).t() for i in range(0, w.shape[0], self.rows)], -1)
        return out if bias is None else out + bias.to(out.dtype)


# ---- the model, one layer at a time ------------------------------------------------------------------


class _Carry:
    """Stands for output ``slot`` (>= 1) of decoder layer ``layer`` where the model's own loop hands it to a
    later layer (Indexer top-k shared across layers, a router state): replaced by the real value, per
    batch, once that layer has run (``substitute``)."""

    __slots__ = ("layer", "slot")

    def __init__(self, layer: int, slot: int):
        self.layer, self.slot = layer, slot

    def __repr__(self):
        return f"<output {self.slot} of decoder layer {self.layer}>"


def substitute(obj, carries: dict):
    """``obj`` (a layer's recorded call arguments) with every ``_Carry`` replaced by its value in
    ``carries`` [(layer, slot)]; one not yet known is an error (a layer would run on a placeholder)."""
    if isinstance(obj, _Carry):
        if (obj.layer, obj.slot) not in carries:
            raise InputError(f"a decoder layer's call takes {obj!r}, which is not known when it runs")
        return carries[(obj.layer, obj.slot)]
    if isinstance(obj, tuple):
        return tuple(substitute(o, carries) for o in obj)
    if isinstance(obj, list):
        return [substitute(o, carries) for o in obj]
    if isinstance(obj, dict):
        return {k: substitute(v, carries) for k, v in obj.items()}
    return obj


def carried(calls) -> set:
    """The (layer, slot) outputs that some recorded layer call takes (its ``_Carry`` placeholders)."""
    if isinstance(calls, _Carry):
        return {(calls.layer, calls.slot)}
    if isinstance(calls, (tuple, list)):
        return set().union(*(carried(c) for c in calls)) if calls else set()
    if isinstance(calls, dict):
        return carried(list(calls.values()))
    return set()


def run_layer(lay, l: int, x, call, carries: dict, needed: set):
    """Decoder layer ``l`` on ``x`` with its recorded ``call`` (args, kwargs), the outputs earlier layers
    hand on substituted; those of its own extra outputs that a later call takes (``needed``) are added to
    ``carries``, detached. Returns the hidden state."""
    args, kwargs = call
    out = lay(x, *substitute(args, carries), **substitute(kwargs, carries))
    if isinstance(out, tuple):
        for k, v in enumerate(out[1:], start=1):
            if (l, k) in needed:
                carries[(l, k)] = v.detach() if isinstance(v, torch.Tensor) else v
        return out[0]
    return out


class _Boundary(torch.nn.Module):
    """Stands in for decoder layer ``index``: records the call's arguments and passes the hidden states on.
    While ``final["x"]`` is set the causal LM's own forward is forming logits from that final hidden state:
    nothing is recorded and the last layer's stand-in returns it. A model whose layers return more than the
    hidden state (``final["arity"]`` > 1) gets ``_Carry`` placeholders for the rest."""

    def __init__(self, index: int, record: dict, final: dict, last: bool, layer: torch.nn.Module | None = None):
        super().__init__()
        self.index, self.record, self.final, self.last = index, record, final, last
        object.__setattr__(self, "_layer", layer)  # not a submodule: its tensors stay out of the model's

    def __getattr__(self, name):
        """What the model's own loop reads of a layer (``attention_type``, ``layer_type``...) from the layer
        stood in for."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = self.__dict__.get("_layer")
            if layer is None:
                raise
            return getattr(layer, name)

    def _out(self, h):
        n = self.final.get("arity", 1)
        return h if n <= 1 else (h, *[_Carry(self.index, k) for k in range(1, n)])

    def forward(self, hidden_states, *args, **kwargs):
        if self.final["x"] is not None:
            if self.last:
                return self._out(self.final["x"])
        else:
            self.record[self.index] = (args, kwargs)
            if self.index == 0:
                self.record["x0"] = hidden_states
        # (perturbed while ``_check_layer_independence`` asks whether anything reads a stand-in's output)
        return self._out(hidden_states * 1.5 + 1.0 if self.final.get("perturb") else hidden_states)


@dataclass
class StreamCfg:
    """What calibration reads of a model's shape (the embedded engine's ``cfg`` fields it uses)."""

    family: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    moe_layers: list[bool]
    vocab_size: int


@dataclass
class _Layer:
    experts: HFExperts | None = None


@dataclass
class _Shim:
    """The engine attributes the scoring code reads: cfg, dtype, device, layers[l].experts."""

    cfg: StreamCfg
    dtype: torch.dtype
    device: torch.device
    layers: dict = field(default_factory=dict)


def _shard_index(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"model.safetensors.index.json is not a valid index ({e})", where=str(index)) from None
        return {k: model_dir / v for k, v in wm.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InputError("no *.safetensors weights", where=str(model_dir))
    out = {}
    for f in files:
        with SafetensorsFile(f) as s:
            for k in s.tensors:
                out[k] = f
    return out


def computed_buffers(model: torch.nn.Module, root: torch.nn.Module) -> dict:
    """The values transformers' own initialisation (``model._init_weights``) gives ``root``'s computed
    (non-persistent) buffers still on the meta device, keyed (module prefix, buffer name): each owning
    module is initialised as a copy whose other tensors are on the meta device (a loaded table is neither
    touched nor copied: Gemma's embedding owns its scale) and whose wanted buffers are NaN on the CPU; a
    buffer the initialisation does not write (still NaN) is left out, to be refused as missing."""
    vals = {}
    for prefix, sub in root.named_modules():
        names = [n for n, t in sub._buffers.items() if t is not None and t.is_meta and t.is_floating_point()
                 and n in sub._non_persistent_buffers_set]
        if not names:
            continue
        memo: dict = {}
        for t in [*sub.parameters(), *sub.buffers()]:
            if not t.is_meta:
                meta = torch.empty_like(t, device="meta")
                memo[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
        clone = copy.deepcopy(sub, memo)
        for n in names:
            clone._buffers[n] = torch.full(clone._buffers[n].shape, float("nan"), dtype=clone._buffers[n].dtype)
        try:
            for m in clone.modules():  # the owner and whatever it holds (a list of rotary tables)
                model._init_weights(m)
        except Exception:  # noqa: BLE001 - left on meta: refused as a missing tensor
            continue
        for n in names:
            v = clone._buffers[n]
            if v.is_floating_point() and not bool(torch.isnan(v).any()):
                vals[(prefix, n)] = v.detach().clone()
    return vals


class StreamedModel:
    """A transformers causal LM whose decoder layers are loaded one at a time (see the module docstring).

    ``device``: where layers run; ``compute_dtype``: what they compute in (default: float32 on CPU,
    as the embedded engine computes there, and the checkpoint dtype on CUDA)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", compute_dtype: torch.dtype | None = None):
        tf, get_mapping, self._load_fn, self._LoadCfg = _transformers()
        self.dir = Path(model_dir)
        self.device = torch.device(device)
        try:
            config = tf.AutoConfig.from_pretrained(str(self.dir))
        except (ValueError, KeyError, OSError) as e:
            raise InputError(f"transformers cannot read this model's config ({e})", where=str(self.dir)) from None
        self.config = config
        self.files = _shard_index(self.dir)
        self.ckpt_dtype = self._checkpoint_dtype()
        self.compute_dtype = compute_dtype or (torch.float32 if self.device.type == "cpu" else self.ckpt_dtype)
        with torch.device("meta"):
            try:
                model = tf.AutoModelForCausalLM.from_config(config, dtype=self.ckpt_dtype)
            except ValueError:
                raise InputError(no_causal_lm(config), where=str(self.dir)) from None
        body = getattr(model, "model", None)
        layers = getattr(body, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or not hasattr(model, "lm_head"):
            raise InputError(layers_elsewhere(model, config), where=str(self.dir))
        adapt_seams(model)
        self.model, self.body, self.layers = model, body, layers
        self.mapping = get_mapping(model)
        self.meta_layers = list(layers)
        # Each layer's tensors as declared (dtype), restored on the meta device when the layer is dropped,
        # so that every load converts the checkpoint's tensors the same way.
        self._declared = [{n: t.dtype for n, t in list(lay.named_parameters()) + list(lay.named_buffers())}
                          for lay in layers]
        self.record: dict = {}
        self._final: dict = {"x": None}
        for i in range(len(layers)):
            layers[i] = _Boundary(i, self.record, self._final, last=i == len(layers) - 1, layer=layers[i])
        self.layer_keys: dict[int, list[str]] = {i: [] for i in range(len(layers))}
        other = []
        runtime = loaded_name(self.mapping)  # a checkpoint key's layer is that of the module it loads into
        for k in self.files:
            m = _LAYER_KEY.search(runtime(k))
            if m and int(m.group(1)) in self.layer_keys and "mtp" not in k:
                self.layer_keys[int(m.group(1))].append(k)
            elif not m:
                other.append(k)
        self.seam = {}
        for i, lay in enumerate(self.meta_layers):
            found = find_experts(lay)
            if found is not None:
                self.seam[i] = (found, ExpertLayout.of(found[0], config.get_text_config().hidden_size))
        if not self.seam:
            raise InputError(f"{type(model).__name__} has {NO_SEAM}", where=str(self.dir))
        self._load(other)
        self._materialize_rest()
        self.cfg = self._cfg()

    # -- loading
    def _infos(self, keys: list[str]) -> dict:
        """The safetensors header entries (dtype, shape, bytes) of ``keys``."""
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.files[k], []).append(k)
        out = {}
        for f, ks in by_file.items():
            with SafetensorsFile(f) as s:
                for k in ks:
                    if k not in s.tensors:
                        raise InputError(f"the index names {k!r} in {f.name}, which does not hold it", where=str(f))
                    out[k] = s.tensors[k]
        return out

    def _checkpoint_dtype(self) -> torch.dtype:
        for k, info in self._infos([k for k in self.files if k.endswith("weight")][:64]).items():
            if info.dtype in (torch.bfloat16, torch.float16, torch.float32):
                return info.dtype
        return torch.float32

    def read_bytes(self, keys: list[str]) -> int:
        """Bytes of the named checkpoint tensors as stored."""
        return sum(i.nbytes for i in self._infos(keys).values())

    def _load(self, keys: list[str]) -> None:
        """Read ``keys`` from the shards and load them into the model through transformers' checkpoint
        conversion (in the compute dtype, on the device)."""
        tf = _transformers()[0]
        sd = {}
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.files[k], []).append(k)
        for f, ks in by_file.items():  # read with pread, not mapped: no file pages held in this process
            with SafetensorsFile(f) as s:
                for k in ks:
                    sd[k] = s.read(k)
        bars = tf.utils.logging.is_progress_bar_enabled()
        tf.utils.logging.disable_progress_bar()
        try:
            info = self._load_fn(self.model, sd, self._LoadCfg(weight_mapping=self.mapping, dtype=self.compute_dtype))
        finally:
            if bars:
                tf.utils.logging.enable_progress_bar()
        info = info[0] if isinstance(info, tuple) else info
        errors = list(getattr(info, "error_msgs", []) or []) + list((getattr(info, "conversion_errors", {}) or {}).values())
        if errors or getattr(info, "mismatched_keys", None):
            raise InputError(f"loading the checkpoint's tensors failed: {(errors or list(info.mismatched_keys))[0]}",
                             where=str(self.dir))

    def _materialize_rest(self) -> None:
        """After the non-layer tensors are loaded: tie the head to the embedding when the checkpoint has
        none, rebuild computed buffers (rotary tables) and move everything but the layers to the device."""
        model, body = self.model, self.body
        head = model.lm_head
        if head.weight.is_meta:
            emb = body.get_input_embeddings() if hasattr(body, "get_input_embeddings") else body.embed_tokens
            if getattr(self.config.get_text_config(), "tie_word_embeddings", False) and not emb.weight.is_meta:
                head.weight = emb.weight
            else:
                raise InputError("the checkpoint has no output head weight (lm_head) and the config does not tie it "
                                 "to the embedding", where=str(self.dir))
        for name, mod in list(body.named_children()):
            if name == "layers":
                continue
            if any(b.is_meta for b in mod.buffers()):
                mods = dict(mod.named_modules())
                for (prefix, n), v in computed_buffers(model, mod).items():
                    mods[prefix]._buffers[n] = v.to(self.device)
        missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                   if t.is_meta and not _LAYER_KEY.search(n)]
        if missing:
            raise InputError(f"the checkpoint has no tensor for {missing[0]}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""), where=str(self.dir))
        emb = body.get_input_embeddings()
        # The two large tables stay in the checkpoint dtype, the embedding only when it is a bare lookup
        # (casting its rows = casting the table): one that computes on its rows (a norm, a scale) runs in
        # the compute dtype like every other module.
        plain = type(emb).forward is torch.nn.Embedding.forward and not any(True for _ in emb.buffers()) \
            and [n for n, _ in emb.named_parameters()] == ["weight"]
        keep = {id(emb), id(head)} if plain else {id(head)}
        for name, mod in body.named_children():
            if name != "layers":
                self._place(mod, cast=id(mod) not in keep)
        self._place(head, cast=False)
        model.lm_head = _CastHead(head)
        if self.compute_dtype != self.ckpt_dtype and emb.weight.dtype != self.compute_dtype:
            body.set_input_embeddings(_CastEmbedding(emb, self.compute_dtype))
        model.requires_grad_(False)
        model.eval()

    def _place(self, mod: torch.nn.Module, cast: bool = True) -> None:
        """Move ``mod`` to the device, its tensors stored in the checkpoint dtype cast to the compute dtype
        (on CPU everything floating computes in float32; tensors transformers keeps in float32, such as
        some routers, stay so), one tensor at a time."""
        cdt = self.compute_dtype
        for t in list(mod.parameters()) + list(mod.buffers()):
            dt = t.dtype
            if cast and t.is_floating_point() and dt != cdt and (dt == self.ckpt_dtype or cdt == torch.float32):
                dt = cdt
            if t.device != self.device or dt != t.dtype:
                t.data = t.data.to(self.device, dt)

    def _cfg(self) -> StreamCfg:
        tc = self.config.get_text_config()
        (mod, _), layout = next(iter(self.seam.values()))
        gu = mod.gate_up_proj
        E = gu.shape[0]
        two_i = gu.shape[2] if layout.transposed else gu.shape[1]
        k = experts_per_token(tc, next(iter(self.seam.values()))[0][1])
        if k < 1:
            raise InputError("the config names no experts per token (num_experts_per_tok)", where=str(self.dir))
        L = len(self.meta_layers)
        return StreamCfg(family=str(getattr(tc, "model_type", "unknown")), num_layers=L, num_experts=int(E), top_k=k,
                         hidden_size=int(tc.hidden_size), expert_intermediate_size=int(two_i // 2),
                         moe_layers=[i in self.seam for i in range(L)], vocab_size=int(tc.vocab_size))

    def layer_param_bytes(self, i: int, dtype: torch.dtype) -> int:
        return sum(p.numel() for p in self.meta_layers[i].parameters()) * torch.empty((), dtype=dtype).element_size()

    def hidden_copies(self, ids: torch.Tensor) -> int:
        """How many hidden-size vectors a token's hidden state between decoder layers holds (1; the copies
        of a hyper-connection model's [batch, tokens, copies, hidden] state), from the embedding's output
        for a few of ``ids``'s tokens."""
        x0, _ = self.boundaries(ids[:1, :16])
        return max(1, x0[0, 0].numel() // int(self.cfg.hidden_size))

    def carried_bytes_per_token(self, ids: torch.Tensor) -> float:
        """Bytes per calibration token of the layer outputs the model's loop hands to later layers, all of
        them (each kept per batch for the whole run, ``run_layer``): decoder layer 0 run on ``ids``'s first
        window (an output's width may grow with the window, as an indexer's top-k does up to its limit), and
        every carried (layer, slot) counted as wide as layer 0's output in that slot. 0 when nothing is
        carried."""
        if "arity" not in self._final:  # learned by the first ``boundaries``
            self.boundaries(ids[:1, :16])
        if not self.carries_outputs:
            return 0.0
        x0, calls = self.boundaries(ids[:1])
        with self.layer(0) as lay, torch.no_grad():
            carries: dict = {}
            run_layer(lay, 0, x0, calls[0], carries, {(0, k) for k in range(1, self._final["arity"])})
        n = max(1, int(x0.shape[:2].numel()))
        per = {slot: v.nbytes / n for (_, slot), v in carries.items() if isinstance(v, torch.Tensor)}
        return sum(per.get(slot, 0.0) for _, slot in self._final.get("carried", ()))

    @property
    def carries_outputs(self) -> bool:
        """Whether the model's own loop hands later decoder layers outputs of a layer besides the hidden
        state (known once ``boundaries`` has run): they are carried per batch (``run_layer``). A carried
        tensor is held constant by the backward pass: a floating-point one (a router state) then gets no
        gradient, and the Fisher scores leave out the paths through it."""
        return self._final.get("arity", 1) > 1

    def resident_param_bytes(self) -> int:
        seen, total = set(), 0
        for n, p in self.model.named_parameters():
            if not _LAYER_KEY.search(n) and id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    @contextlib.contextmanager
    def layer(self, i: int):
        """Decoder layer ``i`` with its weights loaded (dropped again on exit)."""
        lay = self.meta_layers[i]
        stub = self.layers[i]
        self.layers[i] = lay
        try:
            self._load(self.layer_keys[i])
        finally:
            self.layers[i] = stub
        self._computed_buffers(i, lay)
        left = [n for n, t in list(lay.named_parameters()) + list(lay.named_buffers()) if t.is_meta]
        if left:
            self._drop(i)
            raise InputError(f"decoder layer {i}: the checkpoint has no tensor for {left[0]}", where=str(self.dir))
        self._place(lay)
        lay.requires_grad_(False)
        lay.eval()
        try:
            yield lay
        finally:
            self._drop(i)

    def _computed_buffers(self, i: int, lay: torch.nn.Module) -> None:
        """Layer ``i``'s computed (non-persistent) buffers, which no checkpoint holds (a rotary table inside
        the attention), put in place per load: values from ``computed_buffers``, worked out once."""
        cache = self.__dict__.setdefault("_computed", {})
        if i not in cache:
            cache[i] = computed_buffers(self.model, lay)
        mods = dict(lay.named_modules())
        for (prefix, n), v in cache[i].items():
            sub = mods[prefix]
            if sub._buffers[n] is not None and sub._buffers[n].is_meta:
                sub._buffers[n] = v.to(self.device)

    def _drop(self, i: int) -> None:
        """Layer ``i`` back on the meta device in its declared dtypes; the freed memory returned to the system."""
        lay, declared = self.meta_layers[i], self._declared[i]
        for prefix, sub in lay.named_modules():
            for table in (sub._parameters, sub._buffers):
                for n, t in list(table.items()):
                    if t is None:
                        continue
                    meta = torch.empty(t.shape, dtype=declared.get(f"{prefix}.{n}" if prefix else n, t.dtype),
                                       device="meta")
                    table[n] = torch.nn.Parameter(meta, requires_grad=False) if table is sub._parameters else meta
        give_back_freed_memory()

    # -- running
    def boundaries(self, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The embedding output and every decoder layer's call arguments for ``ids`` [B, T]. The first call
        learns, from decoder layer 0 run once, how many outputs a layer returns (see ``_Carry``)."""
        self.record.clear()
        try:
            with torch.no_grad():
                self.body(input_ids=ids.to(self.device), use_cache=False)
        except TrtmoeError:
            raise
        except Exception as e:  # noqa: BLE001 - the model's own loop ran on the stand-ins
            if "arity" not in self._final and 0 in self.record:
                with self.layer(0) as lay, torch.no_grad():
                    out = lay(self.record["x0"], *self.record[0][0], **self.record[0][1])
                self._final["arity"] = len(out) if isinstance(out, tuple) else 1
                if self._final["arity"] > 1:
                    return self.boundaries(ids)
            raise self._stood_in_error(e) from e
        self._final.setdefault("arity", 1)
        calls, x0 = [self.record[i] for i in range(len(self.layers))], self.record["x0"]
        if self._final["arity"] > 1:
            self._final["carried"] = carried(calls)
        if not self._final.get("checked"):
            self._check_layer_independence(ids, x0)
        return x0, calls

    def _stood_in_error(self, e: Exception) -> UnsupportedError:
        """A failure of the model's own forward while every decoder layer was stood in for (recording the
        layers' calls, forming the logits), as one line: not a failure of transformers' layers themselves,
        which run only one at a time here."""
        where = raised_in(e, "transformers")
        msg = (str(e).strip().splitlines() or [""])[0]
        return UnsupportedError(
            f"{type(self.model).__name__}'s own forward failed with its decoder layers stood in for by the "
            f"layer-streamed runner ({where + ': ' if where else ''}{type(e).__name__}: {msg}): its loop needs "
            "more of a layer than the runner hands on, or transformers cannot run this configuration",
            where=str(self.dir))

    def _check_layer_independence(self, ids: torch.Tensor, x0: torch.Tensor) -> None:
        """Refuse a model whose own loop computes a decoder layer's inputs (or the logits) from earlier
        layers' outputs other than through the hidden state handed on (block or dense residual mixes that
        keep every layer's output): run one layer at a time, those inputs would be recorded from the
        stand-ins, silently wrong. Tested once, on a few tokens: the layers' calls recorded again with every
        stand-in's output changed must not change, nor must the logits formed from one final hidden state
        (nor the token ids the head is run with)."""
        self._final["checked"] = True
        few = ids[:1, :16].to(self.device)

        def record(perturb: bool) -> list:
            self.record.clear()
            self._final["perturb"] = perturb
            try:
                with torch.no_grad():
                    self.body(input_ids=few, use_cache=False)
                return [self.record[i] for i in range(len(self.layers))]
            finally:
                self._final["perturb"] = False
                self.record.clear()

        def same(a, b) -> bool:
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                return a.shape == b.shape and bool(torch.equal(a, b))
            if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
                return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
            if isinstance(a, dict) and isinstance(b, dict):
                return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
            return True

        name = type(self.model).__name__
        for i, (c0, c1) in enumerate(zip(record(False), record(True))):
            if not same(c0, c1):
                raise UnsupportedError(f"{name}: the model's own loop computes decoder layer {i}'s inputs from "
                                       "earlier layers' outputs besides the hidden state it hands on; the "
                                       "layer-streamed runner runs one layer at a time and cannot",
                                       where=str(self.dir))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(*few.shape, *x0.shape[2:], generator=g).to(self.device, x0.dtype)
        with torch.no_grad():
            logits = self.head(x)
            self._final["perturb"] = True
            try:
                moved = self.head(x)
            finally:
                self._final["perturb"] = False
            other_ids = self.head(x, fill=1)
        if not (torch.equal(logits, moved) and torch.equal(logits, other_ids)):
            raise UnsupportedError(f"{name}: the model's own forward forms the logits from earlier layers' outputs "
                                   "besides the last one; the layer-streamed runner cannot", where=str(self.dir))

    def head(self, x: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """Logits of the final hidden states ``x`` [B, T, H] as the causal LM's own forward forms them (its
        layers stood in for, the last one handing on ``x``): the body's final norm whatever its name, the
        output head in the compute dtype (its weight cast a block of vocabulary rows at a time when stored
        in another dtype), then whatever the architecture applies to the logits (Granite's
        ``logits_scaling``, Cohere's ``logit_scale``, soft-capping)."""
        self._final["x"] = x
        try:
            out = self.model(input_ids=torch.full(x.shape[:2], fill, dtype=torch.long, device=x.device),
                             use_cache=False, output_router_logits=False)
        except TrtmoeError:
            raise
        except Exception as e:  # noqa: BLE001 - the model's own forward ran on the stand-ins
            raise self._stood_in_error(e) from e
        finally:
            self._final["x"] = None
        return out.logits

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
        """The causal LM's logits, run layer by layer (what the calibration forward computes)."""
        xs, calls = [], []
        for b in ids.split(batch_size):
            x0, c = self.boundaries(b)
            xs.append(x0)
            calls.append(c)
        carries, needed = [{} for _ in xs], carried(calls)
        for i in range(len(self.meta_layers)):
            with self.layer(i) as lay:
                xs = [run_layer(lay, i, x, calls[b][i], carries[b], needed) for b, x in enumerate(xs)]
        return torch.cat([self.head(x).float() for x in xs])


# ---- calibration -----------------------------------------------------------------------------------


def memory_plan(sm: StreamedModel, n_tokens: int, batch_tokens: int, seq_len: int, rounding: str = "rtn",
                cross_fit: bool = False, copies: int = 1, carried_per_token: float = 0.0) -> dict:
    """Bytes the streamed calibration needs at its peak, by part, and what is available. ``rounding``
    other than rtn adds what its statistics hold while a layer is scored: the layer's sampled MoE inputs
    (a second sample per fold when ``cross_fit``) and the Gram matrices and row samples the searches
    rebuild from them (``awq._GRAMS_KEPT``). ``copies``: how many hidden-size vectors the hidden state
    between layers holds per token (``StreamedModel.hidden_copies``). ``carried_per_token``: bytes per
    token of the layer outputs a model's loop hands to later layers
    (``StreamedModel.carried_bytes_per_token``), all held to the end of the run."""
    c = sm.cfg
    tc = sm.config.get_text_config()
    layer = max(sm.layer_param_bytes(i, sm.compute_dtype) + sm.read_bytes(sm.layer_keys[i])
                for i in range(c.num_layers))
    E, I, H = c.num_experts, c.expert_intermediate_size, c.hidden_size
    bank = E * I * H * 4  # the experts' [up; gate] reordering (half of fc in float32) while they are scored
    resident = sm.resident_param_bytes()
    # Two boundaries and two gradients (the hidden state between layers: ``copies`` × H wide with
    # hyper-connections), the MoE inputs and their output gradients (H wide).
    acts = (4 * copies + 2) * n_tokens * H * 4
    heads = int(max_over_layers(tc, "num_attention_heads", 1))
    batch = batch_tokens * c.vocab_size * 4 * 3 + 4 * batch_tokens * seq_len * heads * 4
    parts = {"layer": layer, "scored_experts": bank, "embedding_and_head": resident, "activations": acts,
             "batch": batch}
    if carried_per_token:
        parts["carried_outputs"] = int(carried_per_token * n_tokens)
    if rounding != "rtn":
        sample = min(n_tokens, awq.MAX_INPUT_TOKENS) * (H * 4 + 4 * c.top_k)  # float32 rows, int32 experts
        # one expert's fc and proj, per statistics source: rows, Gram matrix, Gram rows (at most in / 2)
        per = sum(4 * (awq.MAX_ROWS * d + d * d + d // 2 * d) for d in (H, I))
        sources = 3 if cross_fit else 1
        cached = per * min(sources, max(1, awq._GRAMS_KEPT // 6))
        parts["rounding_statistics"] = sample * (2 if cross_fit else 1) + cached
    return {"parts": parts, "total": sum(parts.values()), "available": available_memory(sm.device)}


def max_over_layers(tc, name: str, default: int) -> int:
    """A config field's value, the largest over the layers' own configs when transformers holds it per
    layer (heterogeneous configs, ``per_layer_config``: reading such a field globally raises)."""
    try:
        v = getattr(tc, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError)
        v = None
        per = getattr(tc, "per_layer_config", None)
        n = int(getattr(tc, "num_hidden_layers", 0) or 0)
        vals = []
        for i in range(n if per is not None else 0):
            try:
                vals.append(getattr(per[i], name, None))
            except (KeyError, IndexError, TypeError):  # a layer the per-layer configs leave out
                continue
        vals = [x for x in vals if isinstance(x, int)]
        v = max(vals) if vals else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def available_memory(device: torch.device) -> int:
    """Bytes this process may still use: MemAvailable (host) or the device's free memory (CUDA)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


class _Observer:
    """Hooks on one MoE layer's experts module and router: per call the inputs, routed experts and
    weights, the gradient at the experts' output (when it has one), and the router's entropy sum."""

    def __init__(self, experts: torch.nn.Module, router: torch.nn.Module | None, E: int):
        self.E = E
        self.calls: list[dict] = []
        names = list(inspect.signature(experts.forward).parameters)
        self._names = [n for n in names if n not in ("self", "args", "kwargs")]
        self.handles = [experts.register_forward_pre_hook(self._pre, with_kwargs=True),
                        experts.register_forward_hook(self._post)]
        if router is not None:
            self.handles.append(router.register_forward_hook(self._router))
        self._entropy = 0.0

    def _pre(self, mod, args, kwargs):
        vals = list(args) + [kwargs[n] for n in self._names[len(args):] if n in kwargs]
        h, idx, w = vals[0], vals[1], vals[2]
        self.calls.append({"h": h.detach().reshape(-1, h.shape[-1]).clone(), "idx": idx.detach().reshape(h.numel() // h.shape[-1], -1).clone(),
                           "w": w.detach().float().reshape(h.numel() // h.shape[-1], -1).clone()})

    def _post(self, mod, args, out):
        rec = self.calls[-1]
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, rec=rec: rec.__setitem__("g", g.detach().reshape(-1, g.shape[-1]).clone()))

    def _router(self, mod, args, out):
        logits = out[0] if isinstance(out, tuple) else out
        if isinstance(logits, torch.Tensor) and logits.shape[-1] == self.E:
            with torch.no_grad():
                p = logits.detach().float().reshape(-1, self.E).softmax(-1)
                self._entropy += float((-(p * p.clamp_min(1e-30).log()).sum(-1)).sum())

    def take_entropy(self) -> float:
        e, self._entropy = self._entropy, 0.0
        return e

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def stream_measure(sm: StreamedModel, ids: torch.Tensor, *, formats, min_tokens: int = 16, batch_size: int = 8,
                   progress: Callable[[str, int, int], None] | None = None, work: Path, key: str = "",
                   probe: str = "gaussian", seed: int = 0, rounding=None, estimate_tokens: int = ESTIMATE_TOKENS,
                   notes: list[str] | None = None, clock: PhaseClock | None = None) -> dict:
    """The Fisher measurement of ``sensitivity.fisher_measure``, layer-streamed (see the module docstring);
    returns the calib.json dict. ``clock`` receives the measured seconds per phase: ``boundaries`` and
    ``forward`` (together the layer-streamed forward over the calibration tokens), ``backward``,
    ``statistics``, ``searches``, ``scoring`` and ``io`` (loading layers, the boundary files).

    The steps: the embedding's output for each batch (``boundaries``); the forward pass bottom up, each
    layer's output saved (``_forward_pass``); the backward pass top down, each layer recomputed from its
    saved input, its MoE seam observed and scored (``_backward_layer``, ``_score_streamed_layer``); the
    result (``_streamed_result``). Each step resumes from what an interrupted run with the same ``key``
    saved."""
    if probe not in PROBES:
        raise InputError(f"unknown probe {probe!r}", hint="use " + " or ".join(PROBES))
    notes = notes if notes is not None else []
    rounding = rounding or RTN()
    clock = clock if clock is not None else PhaseClock()  # nobody reads it: no device synchronisation
    run = _StreamRun(sm, ids, batch_size, clock, clock.timed(rounding), progress, _boundary_dir(Path(work), key))
    state = Progress(Path(work), f"{key}|stream|estimate {estimate_tokens}/{ESTIMATE_SHARE}")
    with clock("boundaries"):
        for b in run.batches:
            x, cl = sm.boundaries(b)
            run.x0.append(x.to(sm.compute_dtype))
            run.calls.append(cl)
    resume_g = _forward_pass(run, probe, seed, notes)
    gs = _load(run.gf(resume_g), run.check_batches)
    # 3. backward and scoring, top down.
    tot = _Totals(run, formats)
    for l in range(run.L - 1, -1, -1):
        if l >= resume_g:  # done by an earlier run: its results only
            if l in tot.moe_layers:
                res = _load(state.layer_file(l), lambda d: _check_layer(d, tot.keys, tot.E))
                if hasattr(run.rounding, "restore_layer"):
                    run.rounding.restore_layer(l, res.get("rounding_state"))
                tot.take(res, l)
        else:
            gs = _backward_layer(run, l, gs, tot, state.layer_file(l), min_tokens, estimate_tokens)
        run.tick()
    shutil.rmtree(run.sdir, ignore_errors=True)
    shutil.rmtree(state.acts, ignore_errors=True)
    return _streamed_result(run, tot, probe, min_tokens)


def _boundary_dir(work: Path, key: str) -> Path:
    """The directory of a run's layer-boundary files, emptied when an earlier run with another ``key``
    left it."""
    sdir = work / "stream"
    stamp = sdir / "key.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") != key:
        shutil.rmtree(sdir)
    sdir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"key": key}))
    return sdir


class _StreamRun:
    """What the steps of one ``stream_measure`` share: the model, the calibration batches and each
    batch's per-layer call arguments, the embedding's outputs ``x0``, the clock, the (timed) rounding,
    the progress ticks and the boundary files (``xf(l)``: the input of layer l >= 1; ``gf(l)``: the
    gradient at the input of layer l, l = L the top)."""

    def __init__(self, sm: StreamedModel, ids: torch.Tensor, batch_size: int, clock: PhaseClock, rounding,
                 progress, sdir: Path):
        self.sm, self.clock, self.rounding, self.progress, self.sdir = sm, clock, rounding, progress, sdir
        self.N, self.T = ids.shape
        self.L = sm.cfg.num_layers
        self.batches = list(ids.split(batch_size))
        self.x0: list = []
        self.calls: list = []
        self.carries: list[dict] = []  # per batch, what layers hand later layers (StreamedModel.carries_outputs)
        self.needed: set | None = None
        self.step = 0
        self.tick_total = 2 * self.L + 1

    def xf(self, l: int) -> Path:
        return self.sdir / f"x-{l:03d}.safetensors"

    def gf(self, l: int) -> Path:
        return self.sdir / f"g-{l:03d}.safetensors"

    def check_batches(self, d) -> None:
        """A boundary file: one [batch, T, H] tensor per calibration batch, nothing else."""
        if not (isinstance(d, list) and len(d) == len(self.batches) and all(
                isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[0] == len(b) and t.shape[1] == self.T
                and t.is_floating_point() for t, b in zip(d, self.batches))):
            raise ValueError("not one activation tensor per calibration batch")

    def tick(self) -> None:
        self.step += 1
        if self.progress:
            self.progress("sensitivity", self.step, self.tick_total)

    def layer_call(self, lay, l: int, b: int, x: torch.Tensor) -> torch.Tensor:
        """Decoder layer ``l`` (loaded as ``lay``) on batch ``b``'s input ``x`` (what earlier layers hand on
        taken from ``carries``, filled bottom up by the forward pass)."""
        while len(self.carries) <= b:
            self.carries.append({})
        if self.needed is None:
            self.needed = carried(self.calls)
        return run_layer(lay, l, x, self.calls[b][l], self.carries[b], self.needed)


def _forward_pass(run: _StreamRun, probe: str, seed: int, notes: list[str]) -> int:
    """The forward pass bottom up, each layer's output saved as the next layer's input, then the
    probe's gradient at the top (the head's input) saved: skipped when an earlier run's backward pass
    has begun, resumed from the last saved layer input otherwise. Returns the layer whose input
    gradient the backward pass starts from (L: the top)."""
    sm, clock, L = run.sm, run.clock, run.L
    done_g = [l for l in range(L + 1) if run.gf(l).is_file()]
    resume_g = min(done_g) if done_g else None
    if resume_g is not None:
        clock.resumed = True
        notes.append(f"sensitivity resumed from an interrupted run: layers {resume_g}..{L - 1} were already done")
        if sm.carries_outputs:  # the layers the backward pass reruns take what the layers below hand on
            _refill_carries(run, resume_g)
        run.step += L
        run.tick()
        return resume_g
    # A model whose layers hand later layers more than the hidden state runs its forward pass from the
    # bottom: what was handed on is not in the saved layer inputs.
    start = 0 if sm.carries_outputs else max([l for l in range(1, L + 1) if run.xf(l).is_file()], default=0)
    clock.resumed = clock.resumed or start > 0
    xs = run.x0 if start == 0 else _load(run.xf(start), run.check_batches)
    run.step += start
    for l in range(start, L):
        with clock("io"):
            cm = sm.layer(l)
            lay = cm.__enter__()
        try:
            with clock("forward"), torch.no_grad():
                xs = [run.layer_call(lay, l, b, x) for b, x in enumerate(xs)]
        finally:
            cm.__exit__(None, None, None)
        with clock("io"):
            _save(xs, run.xf(l + 1))
        run.tick()
    gs = []
    for b, x in enumerate(xs):
        with torch.enable_grad():
            xl = x.detach().requires_grad_()
            with clock("forward"):
                logits = sm.head(xl)
            with clock("backward"):
                v = _probe(logits, probe, torch.Generator().manual_seed(seed * 1_000_003 + b))
                logits.backward(v)
        gs.append(xl.grad.detach())
        del logits, v
    with clock("io"):
        _save(gs, run.gf(L))
    run.tick()
    return L


def _refill_carries(run: _StreamRun, upto: int) -> None:
    """Layers 0..``upto``-1 rerun from the embedding's output (nothing saved) for what they hand later
    layers besides the hidden state (``_Carry``), which a resumed run's backward pass needs."""
    xs = run.x0
    for l in range(upto):
        with run.clock("io"):
            cm = run.sm.layer(l)
            lay = cm.__enter__()
        try:
            with run.clock("forward"), torch.no_grad():
                xs = [run.layer_call(lay, l, b, x) for b, x in enumerate(xs)]
        finally:
            cm.__exit__(None, None, None)


class _Totals:
    """The per-layer results the backward pass collects: routing counts, weight mass and entropy, and
    the measured / per-sequence / estimated scores per matrix kind and format key (the formats, and
    the stacked layout's keys where the rounding scores it)."""

    def __init__(self, run: _StreamRun, formats):
        sm, L = run.sm, run.L
        c = sm.cfg
        self.E, self.k = c.num_experts, c.top_k
        self.moe_layers = [l for l in range(L) if c.moe_layers[l]]
        self.counts = torch.zeros(L, self.E, dtype=torch.int64)
        self.mass = torch.zeros(L, self.E, dtype=torch.float64)
        self.entropy = torch.zeros(L, dtype=torch.float64)
        shares = getattr(run.rounding, "shares_prequant", lambda fmt: False)
        ckpt = sm.ckpt_dtype
        self.keys = tuple(formats) + tuple(f + STACKED for f in formats if shares(format_obj(f, ckpt)))
        self.shim = _Shim(c, ckpt, sm.device)
        zeros = lambda: {f: torch.zeros(L, self.E, dtype=torch.float64) for f in self.keys}  # noqa: E731
        self.measured, self.per_seq, self.estimated = ({m: zeros() for m in MATRICES} for _ in range(3))
        self.floor = 0.25 * self.k / self.E
        self.scored = self.est = 0.0
        self.cross_fitted = True

    def take(self, res: dict, l: int) -> None:
        _take(res, l, self.counts, self.mass, self.entropy, self.measured, self.per_seq, self.estimated, self.keys)
        self.scored += res["expert_passes"]
        self.est += res.get("estimate_passes", 0.0)
        self.cross_fitted = self.cross_fitted and bool(res.get("cross_fitted", False))


def _backward_layer(run: _StreamRun, l: int, gs: list, tot: _Totals, lf: Path, min_tokens: int,
                    estimate_tokens: int) -> list:
    """Layer ``l`` recomputed from its saved input and backpropagated with the incoming gradients ``gs``;
    an MoE layer's experts seam is observed meanwhile and scored (``_score_streamed_layer``, its results
    saved in ``lf``). The gradients at the layer's input are saved as the next step's boundary and
    returned."""
    sm, clock = run.sm, run.clock
    with clock("io"):
        xs = run.x0 if l == 0 else _load(run.xf(l), run.check_batches)
        cm = [sm.layer(l)]
        lay = cm[0].__enter__()
    try:
        obs = None
        if l in tot.moe_layers:
            (mod, router), layout = sm.seam[l]
            obs = _Observer(mod, router, tot.E)
        new_g = []
        with clock("backward"):
            for b, x in enumerate(xs):
                with torch.enable_grad():
                    xi = x.detach().requires_grad_()
                    y = run.layer_call(lay, l, b, xi)
                    y.backward(gs[b].to(y.dtype))
                new_g.append(xi.grad.detach())
                del y, xi
        if obs is not None:
            obs.close()
            seen = {n: torch.cat([r[n] for r in obs.calls]) for n in ("h", "g", "idx", "w")}
            ent = obs.take_entropy()
            del obs
            _score_streamed_layer(run, l, seen, ent, mod, layout, cm, tot, lf, min_tokens, estimate_tokens)
            del seen
    finally:
        if cm[0] is not None:
            cm[0].__exit__(None, None, None)
    with clock("io"):
        _save(new_g, run.gf(l))
        run.gf(l + 1).unlink(missing_ok=True)
        if l >= 1:
            run.xf(l).unlink(missing_ok=True)
    return new_g


def _score_streamed_layer(run: _StreamRun, l: int, seen: dict, ent: float, mod, layout, cm, tot: _Totals,
                          lf: Path, min_tokens: int, estimate_tokens: int) -> None:
    """MoE layer ``l``'s routing and sensitivity from what its seam saw (``seen``: inputs ``h``, output
    gradients ``g``, routed experts ``idx`` and weights ``w``): the experts are taken into the
    quantizers' layout, the layer let go (``cm[0]``, its context, exited and cleared), the layer scored
    and its results saved in ``lf``."""
    clock, rounding, N, T = run.clock, run.rounding, run.N, run.T
    idx, w = seen["idx"], seen["w"]
    with clock("scoring"):
        tot.counts[l] = torch.bincount(idx.reshape(-1).cpu(), minlength=tot.E)
        tot.mass[l] = torch.zeros(tot.E, dtype=torch.float64).index_add_(0, idx.reshape(-1).cpu(),
                                                                          w.reshape(-1).cpu().double())
        tot.entropy[l] = ent
        ckpt = run.sm.ckpt_dtype
        tot.shim.layers[l] = _Layer(HFExperts(mod, layout, _FLOAT_NAME.get(ckpt, "fp32")))
    cm[0].__exit__(None, None, None)
    cm[0] = None
    with clock("scoring"):
        share = tot.counts[l].double() / (N * T * tot.k)
        res = score_layer_tensors(tot.shim, l, seen["h"], seen["g"], idx, w, tot.keys, rounding, tot.counts[l],
                                  tot.mass[l], min_tokens, estimate_tokens, T, N, share, tot.floor)
        tot.shim.layers.pop(l)
        _release_weights(rounding, l)
    res["routing"] = {"counts": tot.counts[l].clone(), "weight_mass": tot.mass[l].clone(), "entropy_sum": ent}
    with clock("io"):
        _save(res, lf)
    tot.take(res, l)


def _streamed_result(run: _StreamRun, tot: _Totals, probe: str, min_tokens: int) -> dict:
    """The calib.json dict of the scored layers, with each MoE layer's input amax per matrix kind."""
    scores = {"measured": tot.measured, "per_seq": tot.per_seq, "estimated": tot.estimated, "floor": tot.floor,
              "cross_fitted": tot.cross_fitted and bool(tot.moe_layers)}
    sens, flagged = _under_observed(scores, tot.counts, tot.moe_layers, tot.keys, min_tokens, tot.E)
    out = _result(tot.shim, tot.keys, scores, sens, flagged, tot.counts, tot.mass, tot.entropy, run.N, run.T,
                  probe, min_tokens)
    # Each MoE layer's input amax per matrix kind (the rounding measured it while scoring, and restores
    # it with a resumed layer's results): what the static input scales of FP8 / NVFP4 / W4A8 are made of.
    amax = getattr(run.rounding, "input_amax", None)
    if amax:
        out["input_amax"] = amax_json(amax)
    return out


def _release_weights(rounding, layer: int) -> None:
    """Drop the references a scored layer's activation statistics hold to its float ``fc`` weights (for
    rebuilding ``proj`` inputs while it was scored), so that the layer's weights are freed; a statistic
    without one is what a resumed run restores and what ``convert`` supplies the weight to."""
    stats = getattr(getattr(rounding, "acts", None), "stats", None) or {}
    for (l, _, _), st in stats.items():
        ref = getattr(st, "inputs", None)
        if l == layer and ref is not None and ref.fc is not None:
            ref.fc = ref.act = None
    stacked = getattr(rounding, "_stacked", None)
    if stacked is not None and hasattr(stacked, "_evict"):
        stacked._evict(-1)


def _take(res, l, counts, mass, entropy, measured, per_seq, estimated, keys) -> None:
    r = res["routing"]
    counts[l], mass[l], entropy[l] = r["counts"], r["weight_mass"], r["entropy_sum"]
    for m in MATRICES:
        for f in keys:
            measured[m][f][l] = res["measured"][m][f]
            per_seq[m][f][l] = res["per_seq"][m][f]
            estimated[m][f][l] = res["estimated"][m][f]


def _result(shim, keys, scores, sens, flagged, counts, mass, entropy, N, T, probe, min_tokens) -> dict:
    # The measured cost is no part of calib.json (same inputs, same bytes): calibrate writes it apart.
    formats, sensitivity = fisher_sensitivity(keys, scores, sens, probe, runner="stream")
    stats = {"counts": counts, "weight_mass": mass, "entropy_sum": entropy}
    return build_result(shim, formats, stats, N * T, min_tokens, flagged, sensitivity)
