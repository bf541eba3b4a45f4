"""The unified-HF target: a ModelOpt-style quantized Hugging Face checkpoint, the checkpoint that
TensorRT-LLM's PyTorch backend (``trtllm-serve`` / ``LLM()``), vLLM (``modelopt`` / ``modelopt_mixed``)
and SGLang load directly.

What is written (the layout NVIDIA ModelOpt 0.47's ``export_hf_checkpoint`` writes, checked tensor for
tensor by ``tests/test_unified_hf_conformance.py`` against ModelOpt run in its own environment):

* every quantized linear keeps its Hugging Face module name (experts one by one:
  ``model.layers.{l}.block_sparse_moe.experts.{e}.w1`` for Mixtral, ``model.layers.{l}.mlp.experts.{e}.
  gate_proj`` for the Qwen MoEs) with the format's tensors beside ``weight``: ``weight_scale``,
  ``weight_scale_2`` (NVFP4's global scale), ``input_scale`` (formats that quantize activations);
* routers, the shared-expert gate, embeddings and ``lm_head`` stay in the model dtype and are listed in
  ``exclude_modules`` (``ignore`` in ``config.json``);
* one format everywhere: ``hf_quant_config.json`` names it (``quant_algo``); per-layer formats:
  ``quant_algo: MIXED_PRECISION`` and ``quantized_layers`` maps each quantized module prefix (a layer's
  whole ``experts`` block, or a single linear) to its ``quant_algo`` (and ``group_size``);
* ``config.json`` is the source's with ``quantization_config`` added; weights go to
  ``model-0000i-of-0000N.safetensors`` shards with ``model.safetensors.index.json``; tokenizer and
  generation config files are copied; ``manifest.json`` records the sha256 of every file.

The formats' numerics (scale rules, rounding, packing) are restated here from ModelOpt's exporter
(``modelopt/torch/export/quant_utils.py``, ``qtensor/nvfp4_tensor.py``, ``qtensor/mxfp4_tensor.py``,
``qtensor/fp8_tensor.py``) in the unified-HF tensor convention (``weight`` ``[out, in]``): this module is
the adapter between trtmoe's plan and that convention. Memory stays bounded: one linear (one expert's
matrix) is read, quantized and written at a time, straight into its shard.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import Tensor

from .. import __version__
from ..errors import InputError, UnsupportedError
from ..hf.reader import HFCheckpoint
from ..hf.safetensors_io import StreamingWriter
from .atomic import atomic_directory
from .manifest import write_manifest

KIND = "unified-hf-checkpoint"
TARGETS = ("trtllm-pytorch", "vllm", "sglang")
PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # the exporter whose layout this restates
SHARD_BYTES = 5 << 30  # like ModelOpt / save_pretrained's default shard size

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# E2M1 magnitudes by code (bit 3 is the sign) and the midpoints between neighbours.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])

# Files copied from the source model when present (tokenizer, chat template, generation defaults).
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                "chat_template.json")


# ---- formats -------------------------------------------------------------------------------------

def _e2m1_codes_nearest_even(x: Tensor) -> Tensor:
    """NVFP4's E2M1 rounding (ModelOpt ``NVFP4QTensor._cast_fp4``): nearest value, a tie goes to the
    even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2, 3.5 -> 4, 5 -> 4); beyond
    6 saturates. Returns uint8 codes with the sign in bit 3."""
    a = x.abs()
    bounds = E2M1_BOUNDS.to(x.device)
    code = torch.searchsorted(bounds, a.contiguous())  # bounds strictly below |x|
    # A value exactly on an odd-numbered midpoint (0.75, 1.75, 3.5) rounds up to the even code.
    code = code + (a.unsqueeze(-1) == bounds[[1, 3, 5]]).any(-1).to(code.dtype)
    return (code.to(torch.uint8) | ((x < 0).to(torch.uint8) << 3))


def _e2m1_codes_down_on_tie(x: Tensor) -> Tensor:
    """MXFP4's E2M1 rounding (ModelOpt ``MXFP4QTensor.quantize``): the code counts the midpoints strictly
    below |x|, so every tie goes to the smaller magnitude; the sign bit is set for x <= 0 (zero is
    stored as -0, code 8, as ModelOpt writes it)."""
    code = (x.abs().unsqueeze(-1) > E2M1_BOUNDS.to(x.device)).sum(-1).to(torch.uint8)
    return code | ((x <= 0).to(torch.uint8) << 3)


def _pack_nibbles(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte along the last dim: element 2j in the low nibble, 2j+1 in the high."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _e2m1_value(codes: Tensor) -> Tensor:
    mag = E2M1_VALUES.to(codes.device)[(codes & 0x07).long()]
    return torch.where((codes & 0x08) > 0, -mag, mag)


@dataclass(frozen=True)
class UnifiedFormat:
    """One storage format of a linear in the unified-HF checkpoint.

    ``quant_algo`` is ModelOpt's name (None: unquantized); ``block`` the group/block size written as
    ``group_size``; ``activations`` says whether an ``input_scale`` (a calibrated input amax) is needed.
    """

    name: str
    quant_algo: str | None
    label: str
    block: int | None = None
    activations: bool = False
    scale_suffixes: tuple[str, ...] = ()
    bits_per_weight: float = 16.0  # stored bits per weight, scales counted (per-tensor scales ignored)
    # Which linears that an engine fuses (q/k/v; gate/up) share the weight amax behind their global scale:
    # "experts" (a routed expert's gate and up only), "all" (every fused group), or "" (none needed).
    fused_amax: str = ""

    def layer_config(self) -> dict:
        """The ``quantized_layers`` entry (and the uniform ``quantization`` keys) for this format."""
        d = {"quant_algo": self.quant_algo}
        if self.quant_algo in ("NVFP4", "W4A16_NVFP4"):
            d["group_size"] = self.block
        return d

    def config_group(self) -> dict | None:
        """The ``config.json`` ``quantization_config`` group ModelOpt writes for this format (None: none)."""
        if self.quant_algo == "FP8":
            spec = {"dynamic": False, "num_bits": 8, "type": "float"}
            return {"input_activations": dict(spec), "weights": dict(spec)}
        if self.quant_algo == "NVFP4":
            spec = {"dynamic": False, "group_size": 16, "num_bits": 4, "type": "float"}
            return {"input_activations": dict(spec), "weights": dict(spec)}
        return None

    def shape_problem(self, out_f: int, in_f: int) -> str | None:
        if self.name in ("nvfp4", "mxfp4") and in_f % self.block:
            return f"{self.label} needs in_features divisible by {self.block}, got {in_f}"
        return None

    # -- numerics (ModelOpt's, restated) ------------------------------------------------------------
    def shares_amax(self, kind: str) -> bool:
        """Whether a fused group of linears of ``kind`` gets one weight amax (ModelOpt syncs them at export)."""
        return self.fused_amax == "all" or (self.fused_amax == "experts" and kind == "expert")

    def quantize(self, w: Tensor, input_amax: float | None = None, weight_amax: Tensor | None = None
                 ) -> dict[str, Tensor]:
        """The unified-HF tensors of one linear ``w [out, in]`` (in the model dtype): suffix -> tensor.
        ``weight_amax`` replaces ``w``'s own amax behind the global scale (a fused group's shared one);"""
        if self.quant_algo is None:
            return {"weight": w.contiguous()}
        problem = self.shape_problem(*w.shape)
        if problem:
            raise UnsupportedError(problem)
        wf = w.float()
        amax = w.abs().amax().float() if weight_amax is None else weight_amax.float()
        out = getattr(self, "_q_" + self.name)(w, wf, amax)
        if self.activations:
            if input_amax is None:
                raise UnsupportedError(f"{self.label} quantizes activations and needs a calibrated input amax",
                                       hint="pass calibration token ids (convert --calib-ids) so the inputs are measured")
            out["input_scale"] = torch.tensor(float(input_amax), dtype=torch.float32) / self._input_bound()
        return out

    def _input_bound(self) -> float:
        return E4M3_MAX if self.quant_algo == "FP8" else E2M1_MAX * E4M3_MAX

    def _q_int8(self, w: Tensor, wf: Tensor, amax: Tensor) -> dict[str, Tensor]:
        scale = w.abs().amax(dim=-1).float() / 127.0  # per output channel
        q = (wf / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}

    def _q_fp8(self, w: Tensor, wf: Tensor, amax: Tensor) -> dict[str, Tensor]:
        scale = amax / E4M3_MAX
        # ModelOpt's exporter divides the model-dtype weight, so the quotient is rounded to that dtype
        # before E4M3 (two roundings; a float32 quotient rounds ~3% of the codes differently).
        q = (wf / scale).to(w.dtype)
        return {"weight": q.to(torch.float8_e4m3fn), "weight_scale": scale}

    def _q_fp8_block_wo(self, w: Tensor, wf: Tensor, amax: Tensor) -> dict[str, Tensor]:
        b = self.block
        out_f, in_f = w.shape
        po, pi = -out_f % b, -in_f % b
        padded = torch.nn.functional.pad(wf, (0, pi, 0, po))
        blocks = padded.unflatten(0, (-1, b)).unflatten(-1, (-1, b))  # [no, b, ni, b]
        scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX  # [no, ni]
        if scale.numel() == 1:  # one block: its scale is the (possibly shared) tensor amax's
            scale = (amax / E4M3_MAX).reshape(1, 1)
        full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)
        q = (padded / full).to(torch.float8_e4m3fn)[:out_f, :in_f].contiguous()
        return {"weight": q, "weight_scale": scale.squeeze()}

    def _q_nvfp4(self, w: Tensor, wf: Tensor, amax: Tensor) -> dict[str, Tensor]:
        g = self.block
        scale_2 = amax / (E2M1_MAX * E4M3_MAX)
        blocks = wf.unflatten(-1, (-1, g))
        block_scale = blocks.abs().amax(-1) / (E2M1_MAX * scale_2)
        block_scale[block_scale == 0] = 1.0
        block_scale = block_scale.clamp(min=2 ** -9, max=E4M3_MAX).to(torch.float8_e4m3fn)
        scaled = blocks / (block_scale.float() * scale_2).unsqueeze(-1)
        codes = _e2m1_codes_nearest_even(scaled.flatten(-2))
        return {"weight": _pack_nibbles(codes), "weight_scale": block_scale, "weight_scale_2": scale_2}

    def _q_mxfp4(self, w: Tensor, wf: Tensor, amax: Tensor) -> dict[str, Tensor]:
        g = self.block
        blocks = wf.unflatten(-1, (-1, g))
        amax = blocks.abs().amax(-1, keepdim=True)
        exp = torch.ceil(torch.maximum(torch.log2(amax / E2M1_MAX), torch.tensor(-127.0)))
        codes = _e2m1_codes_down_on_tie((blocks / torch.exp2(exp)).flatten(-2))
        return {"weight": _pack_nibbles(codes), "weight_scale": (exp.squeeze(-1) + 127).to(torch.uint8)}

    def dequantize(self, t: dict[str, Tensor]) -> Tensor:
        """The effective float32 weight ``[out, in]`` of a linear's unified-HF tensors."""
        w = t["weight"]
        if self.quant_algo is None:
            return w.float()
        if self.name == "int8":
            return w.float() * t["weight_scale"].float()[:, None]
        if self.name == "fp8":
            return w.float() * t["weight_scale"].float()
        if self.name == "fp8_block_wo":
            b = self.block
            s = t["weight_scale"].float().reshape(math.ceil(w.shape[0] / b), math.ceil(w.shape[1] / b))
            full = s.repeat_interleave(b, 0).repeat_interleave(b, 1)[:w.shape[0], :w.shape[1]]
            return w.float() * full
        v = _e2m1_value(_unpack_nibbles(w)).unflatten(-1, (-1, self.block))
        if self.name == "nvfp4":
            s = t["weight_scale"].float() * t["weight_scale_2"].float()
        else:  # mxfp4
            s = torch.exp2(t["weight_scale"].float() - 127)
        return (v * s.unsqueeze(-1)).flatten(-2)

    def tensor_specs(self, name: str, out_f: int, in_f: int, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple]]:
        """(tensor name, dtype, shape) of each tensor one linear ``name`` (module prefix) is written as."""
        if self.quant_algo is None:
            return [(f"{name}.weight", dtype, (out_f, in_f))]
        n = self.name
        if n == "int8":
            specs = [("weight", torch.int8, (out_f, in_f)), ("weight_scale", torch.float32, (out_f,))]
        elif n == "fp8":
            specs = [("weight", torch.float8_e4m3fn, (out_f, in_f)), ("weight_scale", torch.float32, ())]
        elif n == "fp8_block_wo":
            s = tuple(d for d in (math.ceil(out_f / self.block), math.ceil(in_f / self.block)) if d != 1)
            specs = [("weight", torch.float8_e4m3fn, (out_f, in_f)), ("weight_scale", torch.float32, s)]
        elif n == "nvfp4":
            specs = [("weight", torch.uint8, (out_f, in_f // 2)),
                     ("weight_scale", torch.float8_e4m3fn, (out_f, in_f // self.block)),
                     ("weight_scale_2", torch.float32, ())]
        else:  # mxfp4
            specs = [("weight", torch.uint8, (out_f, in_f // 2)), ("weight_scale", torch.uint8, (out_f, in_f // self.block))]
        if self.activations:
            specs.append(("input_scale", torch.float32, ()))
        return [(f"{name}.{s}", dt, shape) for s, dt, shape in specs]


FORMATS: dict[str, UnifiedFormat] = {f.name: f for f in (
    UnifiedFormat("bf16", None, "BF16 (unquantized)"),
    UnifiedFormat("fp8", "FP8", "FP8 per-tensor (W8A8)", activations=True, bits_per_weight=8.0,
                  fused_amax="experts"),
    UnifiedFormat("fp8_block_wo", "fp8_pb_wo", "FP8 128x128 blocks, weight-only", block=128, bits_per_weight=8.0,
                  fused_amax="all"),
    UnifiedFormat("nvfp4", "NVFP4", "NVFP4 (W4A4, E4M3 scales per 16)", block=16, activations=True,
                  bits_per_weight=4.5, fused_amax="all"),
    UnifiedFormat("mxfp4", "mxfp4", "MXFP4 (W4A16, E8M0 scales per 32)", block=32, bits_per_weight=4.25),
    UnifiedFormat("int8", "W8A16", "INT8 per-channel weight-only (W8A16)", bits_per_weight=8.0),
)}
# trtmoe's float format names all mean "leave it unquantized" here.
FLOAT_ALIASES = ("bf16", "fp16", "float", "float16", "bfloat16", "fp32")


def get_format(name: str) -> UnifiedFormat:
    key = "bf16" if name in FLOAT_ALIASES else name
    if key not in FORMATS:
        raise UnsupportedError(f"format {name!r} has no unified-HF (ModelOpt) form",
                               hint="formats: " + ", ".join(FORMATS))
    return FORMATS[key]


def format_for_algo(quant_algo: str | None, group_size: int | None = None) -> UnifiedFormat:
    for f in FORMATS.values():
        if f.quant_algo == quant_algo:
            return f
    raise UnsupportedError(f"quant_algo {quant_algo!r} is not one trtmoe reads")


# ---- which module is what ------------------------------------------------------------------------

@dataclass(frozen=True)
class Module:
    """One linear of the source checkpoint (``name`` without ``.weight``)."""

    name: str
    kind: str  # "expert", "attention", "shared", "dense", "excluded"
    layer: int | None
    shape: tuple[int, int]
    expert_role: str | None = None  # "gate" / "up" / "down" for routed experts
    group: str | None = None  # the quantized_layers prefix of a routed expert: "...layers.{l}.<moe>.experts"

    @property
    def fusion(self) -> str | None:
        """The linears an engine fuses with this one share this key (q/k/v; gate/up), else None."""
        parent, _, leaf = self.name.rpartition(".")
        if leaf in ("q_proj", "k_proj", "v_proj"):
            return parent + ".qkv"
        if leaf in ("gate_proj", "up_proj", "w1", "w3"):
            return parent + ".gate_up"
        return None


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def classify(ck: HFCheckpoint) -> list[Module]:
    """Every 2-D ``*.weight`` of the checkpoint as a linear module, in the checkpoint's name order."""
    ad, spec = ck.adapter, ck.model
    expert_of: dict[str, tuple[int, str]] = {}
    excluded = set()
    for l, moe in enumerate(spec.moe_layers):
        if not moe:
            continue
        for e in range(spec.num_experts):
            for role in ("gate", "up", "down"):
                expert_of[ad.name(f"expert_{role}", l, e)] = (l, role)
        for role in ("router", "shared_expert_gate"):
            if role in ad.names:
                excluded.add(ad.name(role, l))
    mods = []
    for name in sorted(ck.location):
        info = ck.info(name)
        if not name.endswith(".weight") or len(info.shape) != 2:
            continue
        mod = name[: -len(".weight")]
        shape = tuple(info.shape)
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m else None
        if name in expert_of:
            l, role = expert_of[name]
            group = mod.rsplit(".", 2)[0]  # drop ".{e}.w1"
            mods.append(Module(mod, "expert", l, shape, role, group))
        elif name in excluded or layer is None:
            mods.append(Module(mod, "excluded", layer, shape))
        elif ".self_attn." in name:
            mods.append(Module(mod, "attention", layer, shape))
        elif ".shared_expert" in name:
            mods.append(Module(mod, "shared", layer, shape))
        else:
            mods.append(Module(mod, "dense", layer, shape))
    return mods


# ---- the plan ------------------------------------------------------------------------------------

@dataclass
class UnifiedPlan:
    """Which format each linear gets: routed experts per MoE layer (``expert_formats[l]``), and
    attention / shared experts / dense MLPs as their own decisions (``other_formats[kind]``)."""

    expert_formats: dict[int, str]
    other_formats: dict[str, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @classmethod
    def uniform(cls, fmt: str, moe_layers: Iterable[int]) -> "UnifiedPlan":
        """One format for every quantizable linear, as ModelOpt's preset configs quantize a model."""
        f = get_format(fmt).name
        return cls({l: f for l in moe_layers}, {"attention": f, "shared": f, "dense": f}, {"policy": "uniform"})

    def format_of(self, m: Module) -> UnifiedFormat:
        if m.kind == "excluded":
            return FORMATS["bf16"]
        if m.kind == "expert":
            return get_format(self.expert_formats.get(m.layer, "bf16"))
        return get_format(self.other_formats.get(m.kind, "bf16"))

    def used(self) -> set[str]:
        return {get_format(f).name for f in (*self.expert_formats.values(), *self.other_formats.values())}


def quant_configs(mods: list[Module], plan: UnifiedPlan) -> tuple[dict, dict]:
    """``hf_quant_config.json`` and ``config.json``'s ``quantization_config`` for a plan, as ModelOpt
    writes them: one format everywhere -> that ``quant_algo`` with ``exclude_modules``; several ->
    ``MIXED_PRECISION`` with ``quantized_layers`` (a routed-expert layer by its ``experts`` prefix)."""
    fmts = {m.name: plan.format_of(m) for m in mods}
    quantized = {n: f for n, f in fmts.items() if f.quant_algo}
    algos = {f.quant_algo for f in quantized.values()}
    excluded = _collapse((n for n, f in fmts.items() if not f.quant_algo), fmts)
    q: dict = {"kv_cache_quant_algo": None}
    if not quantized:
        q.update(quant_algo=None, exclude_modules=excluded)
    elif len(algos) == 1:
        f = next(iter(quantized.values()))
        q.update(f.layer_config(), exclude_modules=excluded)
    else:
        layers: dict[str, dict] = {}
        for m in mods:
            f = fmts[m.name]
            if f.quant_algo:
                layers[m.group if m.kind == "expert" else m.name] = f.layer_config()
        q.update(quant_algo="MIXED_PRECISION", quantized_layers=dict(sorted(layers.items())))
    hf_quant = {"producer": dict(PRODUCER), "quantization": dict(sorted(q.items()))}
    qc = {"producer": dict(PRODUCER), "quant_method": "modelopt", "quant_algo": q["quant_algo"],
          "ignore": q.get("exclude_modules", [])}
    if q["quant_algo"] == "MIXED_PRECISION":
        qc["quantized_layers"] = q["quantized_layers"]
        groups: list[tuple[dict, list[str]]] = []
        for prefix, entry in q["quantized_layers"].items():
            g = format_for_algo(entry["quant_algo"]).config_group()
            if g is None:
                continue
            for known, targets in groups:
                if known == g:
                    targets.append(prefix)
                    break
            else:
                groups.append((g, [prefix]))
        if groups:
            qc["config_groups"] = {f"group_{i}": {**g, "targets": t} for i, (g, t) in enumerate(groups)}
    else:
        g = format_for_algo(q["quant_algo"]).config_group() if q["quant_algo"] else None
        if g is not None:
            qc["config_groups"] = {"group_0": {**g, "targets": ["Linear"]}}
    return hf_quant, qc


def _collapse(excluded: Iterable[str], everything: Iterable[str]) -> list[str]:
    """Unquantized modules as ModelOpt lists them: the largest module subtree whose linears and
    embeddings are all unquantized, as ``prefix*`` (``model.layers.1*``, ``model.layers.0.self_attn*``),
    or the module's own name when that subtree is the module alone (``lm_head``, a router)."""
    excluded = set(excluded)
    leaves = set(everything)

    def ancestors(n):
        parts = n.split(".")
        return [".".join(parts[:i]) for i in range(len(parts) - 1, 1, -1)]  # never "model" itself

    out = set()
    for n in excluded:
        best = n
        for a in ancestors(n):
            if all(l in excluded for l in leaves if l.startswith(a + ".")):
                best = a
            else:
                break
        out.add(n if best == n else best + "*")
    return sorted(out)


# ---- input amax ----------------------------------------------------------------------------------

def measure_input_amax(model_dir: str | Path, token_ids: list[list[int]]) -> dict[str, float]:
    """Per linear, the largest |input| seen on ``token_ids`` (the model run in its dtype with
    transformers): what ModelOpt's max calibration records. A layer's routed experts share one value
    per projection (gate/up: the layer's expert input; down: the largest intermediate any expert
    produced), as ModelOpt synchronises them for the fused kernels. Keys are module names as written
    (per expert). Holds the whole model: for the checkpoints a single host can run in transformers."""
    from transformers import AutoModelForCausalLM  # optional heavy dependency, only for this measurement

    ck = HFCheckpoint(model_dir)
    mods = classify(ck)
    ck.close()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto").eval()
    amax: dict[str, float] = {}

    def bump(key, value):
        amax[key] = max(amax.get(key, 0.0), float(value))

    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, name=name: bump(name, args[0].detach().abs().amax())))
        elif type(mod).__name__.endswith("Experts") and hasattr(mod, "gate_up_proj"):
            layer = int(_LAYER.search("." + name + ".").group(1))

            def on_experts(m, args, kwargs, layer=layer):
                x, idx = (args + tuple(kwargs.values()))[:2]
                bump(("experts_in", layer), x.detach().abs().amax())
                for e in range(m.gate_up_proj.shape[0]):
                    rows = (idx == e).any(-1)
                    if rows.any():
                        gate, up = torch.nn.functional.linear(x[rows], m.gate_up_proj[e]).chunk(2, dim=-1)
                        bump(("experts_mid", layer), (m.act_fn(gate) * up).detach().abs().amax())
            hooks.append(mod.register_forward_pre_hook(on_experts, with_kwargs=True))
    with torch.no_grad():
        for row in token_ids:
            model(input_ids=torch.tensor([row]))
    for h in hooks:
        h.remove()
    out = {}
    for m in mods:
        if m.kind == "expert":
            key = ("experts_mid" if m.expert_role == "down" else "experts_in", m.layer)
            if key in amax:
                out[m.name] = amax[key]
        else:
            hf_name = m.name
            if hf_name in amax:
                out[hf_name] = amax[hf_name]
            else:  # transformers 5 module names differ from the hub names for some layouts
                alt = hf_name.replace(".block_sparse_moe.", ".mlp.")
                if alt in amax:
                    out[m.name] = amax[alt]
    return out


# ---- the writer ----------------------------------------------------------------------------------

@dataclass
class UnifiedResult:
    out_dir: Path
    bytes_written: int
    files: list[str]
    hf_quant_config: dict
    plan: UnifiedPlan
    manifest: dict


def _shards(entries: list[tuple[Module, list[tuple[str, torch.dtype, tuple]]]], shard_bytes: int):
    shards: list[list] = [[]]
    used = 0
    for mod, specs in entries:
        nb = sum(math.prod(s) * dt.itemsize for _, dt, s in specs)
        if shards[-1] and used + nb > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((mod, specs))
        used += nb
    return shards


def write_unified_checkpoint(model: str | Path, out: str | Path, plan: UnifiedPlan, *, target: str = "trtllm-pytorch",
                             input_amax: dict[str, float] | None = None, force: bool = False,
                             shard_bytes: int = SHARD_BYTES, dtype: torch.dtype | None = None,
                             progress: Callable[[int, int], None] | None = None,
                             extra_manifest: dict | None = None) -> UnifiedResult:
    """Write ``model`` (an HF MoE checkpoint directory) as a unified-HF checkpoint in ``out``, atomically.

    ``plan`` gives each linear its format; ``input_amax`` (module name -> amax) is needed for formats that
    quantize activations. Tensors that stay unquantized are written in ``dtype`` (default: the source's
    dtype). Streams one linear at a time."""
    if target not in TARGETS:
        raise InputError(f"unknown unified-HF target {target!r}", hint="one of " + ", ".join(TARGETS))
    input_amax = input_amax or {}
    ck = HFCheckpoint(model)
    try:
        mods = classify(ck)
        linear_names = {m.name + ".weight" for m in mods}
        src_dtype = ck.info(mods[0].name + ".weight").dtype if mods else torch.bfloat16
        dtype = dtype or src_dtype
        entries = []
        for m in mods:
            f = plan.format_of(m)
            problem = f.shape_problem(*m.shape)
            if problem:
                raise UnsupportedError(f"{m.name}: {problem}", hint="choose another format for this layer")
            if f.activations and m.name not in input_amax:
                raise UnsupportedError(f"{m.name}: {f.label} needs the input amax of this linear, which was not measured",
                                       hint="pass calibration token ids (convert --calib-ids FILE) so the inputs are "
                                            "measured, or a weight-only format")
            entries.append((m, f.tensor_specs(m.name, *m.shape, dtype)))
        for name in sorted(ck.location):
            if name not in linear_names:  # norms, biases, 1-D tensors: copied in the model dtype
                info = ck.info(name)
                keep = info.dtype if not info.dtype.is_floating_point else dtype
                entries.append((None, [(name, keep, tuple(info.shape))]))
        entries.sort(key=lambda e: e[1][0][0])
        shards = _shards(entries, shard_bytes)
        total = sum(math.prod(s) * dt.itemsize for _, specs in entries for _, dt, s in specs)
        hf_quant, qc = quant_configs(mods, plan)
        cfg = json.loads((ck.path / "config.json").read_text())
        cfg["quantization_config"] = qc
        by_fusion: dict[str, list[Module]] = {}
        for m in mods:
            if m.fusion:
                by_fusion.setdefault(m.fusion, []).append(m)
        amax_cache: dict[str, Tensor] = {}

        def fused_amax(key: str) -> Tensor:
            """The largest |w| over a fused group (read member by member; the last group is cached)."""
            if key not in amax_cache:
                amax_cache.clear()
                amax_cache[key] = torch.stack([ck.read(m.name + ".weight").to(dtype).abs().amax().float()
                                               for m in by_fusion[key]]).amax()
            return amax_cache[key]

        done = 0
        hashes: dict[str, str] = {}
        weight_map: dict[str, str] = {}
        with atomic_directory(out, force=force, inputs=(ck.path,)) as tmp:
            n = len(shards)
            for i, shard in enumerate(shards, start=1):
                fname = f"model-{i:05d}-of-{n:05d}.safetensors"
                specs = [s for _, ss in shard for s in ss]
                w = StreamingWriter(tmp / fname, specs, metadata={"format": "pt"})
                try:
                    for mod, ss in shard:
                        if mod is None:
                            name, dt, _ = ss[0]
                            w.write(ck.read(name).to(dt))
                            continue
                        f = plan.format_of(mod)
                        src = ck.read(mod.name + ".weight").to(dtype)
                        shared = None
                        if f.quant_algo and mod.fusion and f.shares_amax(mod.kind):
                            shared = fused_amax(mod.fusion)
                        packed = f.quantize(src, input_amax.get(mod.name), shared)
                        for tname, dt, shape in ss:
                            t = packed[tname[len(mod.name) + 1:]]
                            w.write(t.to(dt).reshape(shape).contiguous())
                        done += sum(math.prod(s) * dt.itemsize for _, dt, s in ss)
                        if progress:
                            progress(done, total)
                except BaseException:
                    w.abort()
                    raise
                hashes[fname] = w.close()
                weight_map.update({s[0]: fname for s in specs})
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4, sort_keys=True) + "\n")
            for fn in COPIED_FILES:
                if (ck.path / fn).is_file():
                    shutil.copyfile(ck.path / fn, tmp / fn)
            manifest = write_manifest(
                tmp, kind=KIND, file_hashes=hashes, target=target, source=str(ck.path),
                architecture=ck.adapter.family, trtmoe_version=__version__,
                plan={"expert_formats": {str(k): v for k, v in sorted(plan.expert_formats.items())},
                      "other_formats": dict(plan.other_formats), **plan.meta},
                quant_algo=hf_quant["quantization"]["quant_algo"], **(extra_manifest or {}))
        files = sorted(hashes)
        return UnifiedResult(Path(out), total, files, hf_quant, plan, manifest)
    finally:
        ck.close()


# ---- reading one back ----------------------------------------------------------------------------

def read_layer_formats(ckpt: str | Path) -> dict[str, UnifiedFormat]:
    """Module prefix -> format, from a unified-HF checkpoint's ``hf_quant_config.json``
    (``{"*": fmt}`` for a uniform one)."""
    q = json.loads((Path(ckpt) / "hf_quant_config.json").read_text())["quantization"]
    if q.get("quant_algo") == "MIXED_PRECISION":
        return {p: format_for_algo(e["quant_algo"]) for p, e in q["quantized_layers"].items()}
    return {"*": format_for_algo(q.get("quant_algo"))}
