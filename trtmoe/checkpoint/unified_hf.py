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

The formats' numerics (scale rules, rounding, packing) and their ModelOpt tensors live in one place,
the format classes of ``trtmoe/quant/formats.py`` (``modelopt_export``, ``modelopt_tensor_specs``,
``modelopt_dequantize``), which the embedded engine runs too; this module maps trtmoe's plan onto
modules, names the tensors and writes the files. DeepSeek-V3, gpt-oss and OLMoE, which trtmoe's
architecture adapters do not describe, are read by their Hugging Face tensor names (:class:`SourceModel`,
:func:`classify_by_name`), as are GLM-4.5 and Llama-4's text model; gpt-oss's experts keep its release's
stacked layout (MXFP4 as ``*_blocks`` / ``*_scales``), Llama-4's keep theirs as ModelOpt exports them
(``feed_forward.experts.gate_up_proj`` ``[E, in, out]`` with ``gate_up_proj_weight_scale`` ... beside it,
one per-tensor scale per stack). Memory stays bounded: one linear (one expert's matrix, or one expert
stack) is read, quantized and written at a time, straight into its shard.
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
from ..errors import CheckpointError, InputError, UnsupportedError
from ..hf.adapters import adapter_for
from ..hf.experts_seam import expert_input_weight
from ..hf.loaded_names import loaded_name
from ..hf.reader import HFCheckpoint
from ..hf.safetensors_io import SafetensorsFile, StreamingWriter
from ..quant import awq
from ..quant import formats as QF
from ..quant.formats import QuantFormat
from . import unified_support as S
from .atomic import atomic_directory
from .manifest import write_manifest

KIND = "unified-hf-checkpoint"
TARGETS = ("trtllm-pytorch", "vllm", "sglang")  # the built-in ones; trtmoe.targets registers each (and checks names)
PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # the exporter whose layout this restates
SHARD_BYTES = 5 << 30  # like ModelOpt / save_pretrained's default shard size

# Tensors written in float32 whatever the model dtype: DeepSeek-V3's routing correction bias, a float32
# buffer in transformers' model (ModelOpt's export writes it so) that the engines read in float32.
FLOAT32_TENSORS = (".e_score_correction_bias",)

# Files copied from the source model when present (tokenizer, chat template, generation defaults).
COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                "chat_template.json")


# ---- formats ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UnifiedFormat:
    """One storage format of a linear in the unified-HF checkpoint: a format of ``trtmoe.quant.formats``
    (which owns the numerics, the tensors and their specs) plus what this checkpoint layout adds.

    ``quant_algo`` is ModelOpt's name (None: unquantized); ``activations`` says whether an ``input_scale`` (a calibrated input amax) is needed. ``fused_amax`` says which
    linears an engine fuses (q/k/v; gate/up) share the weight amax behind their per-tensor scale:
    "experts" (a routed expert's gate and up only), "all" (every fused group) or "" (none needed).
    """

    name: str
    fmt: QuantFormat
    label: str
    fused_amax: str = ""

    @property
    def quant_algo(self) -> str | None:
        return self.fmt.modelopt_quant_algo

    @property
    def activations(self) -> bool:
        return self.fmt.needs_input_amax

    def layer_config(self) -> dict:
        """The ``quantized_layers`` entry (and the uniform ``quantization`` keys) for this format."""
        return self.fmt.modelopt_layer_config() or {"quant_algo": None}

    def shape_problem(self, out_f: int, in_f: int) -> str | None:
        return self.fmt.shape_problem(out_f, in_f)

    def shares_amax(self, kind: str) -> bool:
        """Whether a fused group of linears of ``kind`` gets one weight amax (ModelOpt syncs them at export)."""
        return self.fused_amax == "all" or (self.fused_amax == "experts" and kind == "expert")

    def quantize(self, w: Tensor, input_amax: float | None = None, weight_amax: Tensor | None = None
                 ) -> dict[str, Tensor]:
        """The unified-HF tensors of one linear ``w [out, in]`` (in the model dtype): suffix -> tensor.
        ``weight_amax`` replaces ``w``'s own amax behind the per-tensor scale (a fused group's shared one)."""
        if self.activations and input_amax is None:
            raise UnsupportedError(f"{self.label} quantizes activations and needs a calibrated input amax",
                                   hint="pass calibration token ids (convert --calib-ids) so the inputs are measured")
        return self.fmt.modelopt_export(w, dtype=w.dtype, input_amax=input_amax, weight_amax=weight_amax)

    def dequantize(self, t: dict[str, Tensor]) -> Tensor:
        """The effective float32 weight ``[out, in]`` of a linear's unified-HF tensors."""
        return self.fmt.modelopt_dequantize(t)

    def tensor_specs(self, name: str, out_f: int, in_f: int, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple]]:
        """(tensor name, dtype, shape) of each tensor one linear ``name`` (module prefix) is written as."""
        return [(f"{name}.{s}", dt, tuple(shape)) for s, dt, shape in self.fmt.modelopt_tensor_specs(out_f, in_f, dtype)]


# trtmoe format name -> its unified-HF form (the numerics are the quant/formats.py format's).
FORMATS: dict[str, UnifiedFormat] = {f.name: f for f in (
    UnifiedFormat("bf16", QF.get_format("bf16"), "BF16 (unquantized)"),
    UnifiedFormat("fp8", QF.get_format("fp8"), "FP8 per-tensor (W8A8)", fused_amax="experts"),
    UnifiedFormat("fp8_block_wo", QF.get_format("fp8_block_wo"), "FP8 128x128 blocks, weight-only", fused_amax="all"),
    UnifiedFormat("nvfp4", QF.get_format("nvfp4"), "NVFP4 (W4A4, E4M3 scales per 16)", fused_amax="all"),
    UnifiedFormat("nvfp4_w4a16", QF.get_format("nvfp4_w4a16"), "NVFP4 weight-only (W4A16, E4M3 scales per 16)",
                  fused_amax="all"),
    UnifiedFormat("mxfp4", QF.get_format("mxfp4"), "MXFP4 (W4A16, E8M0 scales per 32)"),
    UnifiedFormat("int8", QF.get_format("int8"), "INT8 per-channel weight-only (W8A16)"),
    UnifiedFormat("w4a8_awq", QF.get_format("w4a8_awq"), "INT4 g128 weights, FP8 activations (W4A8 AWQ)",
                  fused_amax="all"),
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


def config_group(layer: dict) -> dict:
    """The ``config.json`` ``quantization_config`` group ModelOpt writes for a ``quantized_layers`` entry
    (compressed-tensors style: what the weights and inputs are); ``{"quant_algo": ...}`` alone for a
    format it has no description of, as ModelOpt 0.47 writes it."""
    algo, gs = layer["quant_algo"], layer.get("group_size")
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    if algo == "FP8":
        return {"input_activations": dict(fp8), "weights": dict(fp8)}
    if algo == "NVFP4":
        spec = {"dynamic": False, "group_size": gs or 16, "num_bits": 4, "type": "float"}
        return {"input_activations": dict(spec), "weights": dict(spec)}
    if algo == "W4A16_NVFP4":
        return {"weights": {"dynamic": False, "group_size": gs or 16, "num_bits": 4, "type": "float"}}
    if algo == "W4A8_AWQ":
        return {"input_activations": {**fp8, "group_size": gs or 128},
                "weights": {"dynamic": False, "group_size": gs or 128, "num_bits": 4, "type": "float"}}
    if algo == "W8A16":
        return {"weights": {"dynamic": False, "num_bits": 8, "type": "int"}}
    return {"quant_algo": algo}


# The quant_algos whose uniform checkpoints ModelOpt describes with one config group for every Linear.
UNIFORM_CONFIG_GROUPS = ("FP8", "NVFP4", "W4A16_NVFP4")


# ---- which module is what ------------------------------------------------------------------------

# Architectures whose checkpoints are read by tensor name here (transformers has them; the TensorRT-LLM
# engine path, and so trtmoe's architecture adapters, never had them): config.json model_type -> family.
NAMED_FAMILIES = {"olmoe": "olmoe", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss",
                  "glm4_moe": "glm4_moe", "llama4_text": "llama4_text", "llama4": "llama4"}
# Llama-4's released multimodal checkpoints (Llama4ForConditionalGeneration): the text model under
# ``language_model.``, and these towers, which stay in the model dtype as ModelOpt leaves them.
UNQUANTIZED_TOWERS = ("vision_model.", "multi_modal_projector.")
# Families whose routed experts are stored as one ``[E, in, out]`` stack per projection, and the layout the
# quantized stack keeps: gpt-oss's release names (MXFP4 ``*_blocks`` / ``*_scales``), or ModelOpt's
# Llama-4 form (the stack's own name, its scales beside it as ``{name}_weight_scale`` ...).
STACK_LAYOUT = {"gpt_oss": "gpt_oss", "llama4_text": "llama4", "llama4": "llama4"}
LLAMA4_FAMILIES = ("llama4_text", "llama4")
# Llama-4's stacked experts in the formats ModelOpt 0.47 exports them in a layout the engines read
# (per-tensor FP8, NVFP4 with or without activations); its INT8 export of the stack fails, and its MXFP4
# and FP8-block forms scale along other axes than the ones it quantized (no loader reads them).
LLAMA4_EXPERT_FORMATS = ("bf16", "fp8", "nvfp4", "nvfp4_w4a16")
# Families whose attention is multi-head latent attention (its projections stay in the model dtype).
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")


class SourceModel:
    """The Hugging Face MoE checkpoint being exported: tensors by name, its family and config.

    The architectures trtmoe's adapters describe are read through :class:`HFCheckpoint` (validated, with
    quantized source weights dequantized); DeepSeek-V3, gpt-oss and OLMoE (``NAMED_FAMILIES``) by their
    tensor names, straight from the safetensors files."""

    def __init__(self, model: str | Path):
        cfg_path = Path(model) / "config.json"
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            raw = None  # HFCheckpoint says what is wrong with it
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        self._ck: HFCheckpoint | None = None
        self._files: dict[Path, SafetensorsFile] = {}
        if model_type in NAMED_FAMILIES:
            self._read_by_name(model, raw)
            self.family = NAMED_FAMILIES[model_type]
            if any(n.endswith("_blocks") for n in self.location):
                self.close()
                raise UnsupportedError(f"{self.path.name} stores its experts in MXFP4 already (*_blocks / *_scales)",
                                       where=str(self.path), hint="export from the BF16 release of the model")
        elif _outside_registry(raw):
            self._read_by_name(model, raw)
            self.family = S.GENERIC
            if not any(_GENERIC_EXPERT.match(n) for n in self.location):
                self.close()
                _refuse_unread_architecture(cfg_path, raw)
        else:
            self._ck = HFCheckpoint(model)
            self.path, self.family, self.hf_config = self._ck.path, self._ck.adapter.family, self._ck.hf_config
            self.location = self._ck.location

    def _read_by_name(self, model: str | Path, hf_config: dict) -> None:
        self.path = Path(model).resolve()
        self.hf_config = hf_config
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError("no *.safetensors weights", where=str(self.path))
        self.location: dict[str, Path] = {}
        for f in files:
            self._files[f] = SafetensorsFile(f)
            for name in self._files[f].tensors:
                self.location[name] = f

    def info(self, name: str):
        return self._ck.info(name) if self._ck else self._files[self.location[name]].tensors[name]

    def read(self, name: str) -> Tensor:
        return self._ck.read(name) if self._ck else self._files[self.location[name]].read(name)

    def modules(self) -> list["Module"]:
        if self._ck:
            return classify(self._ck)
        return classify_generic(self) if self.family == S.GENERIC else classify_by_name(self)

    def close(self) -> None:
        if self._ck:
            self._ck.close()
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _outside_registry(raw) -> bool:
    """Whether the parsed ``config.json`` names an architecture that trtmoe's registry does not describe
    (False for one that could not be read: HFCheckpoint says what is wrong with it)."""
    if not isinstance(raw, dict):
        return False
    try:
        adapter_for(raw)
    except UnsupportedError:
        return True
    return False


def _refuse_unread_architecture(cfg_path: Path, raw: dict) -> None:
    """One line naming a model outside the registry whose routed experts are not stored one linear per expert
    under the names the by-name reader knows."""
    model_type = raw.get("model_type")
    arch = (raw.get("architectures") or [None])[0] or "(none given)"
    raise UnsupportedError(
        f"the unified-HF export does not read {arch} (model_type {model_type!r}): its routed experts are not "
        f"stored one linear per expert as <...>.layers.L.<...>.experts.E.{{gate_proj,up_proj,down_proj}} or "
        f"{{w1,w3,w2}}", where=str(cfg_path),
        hint="`trtmoe calibrate --runner stream` measures any transformers MoE with a *Experts module")


@dataclass(frozen=True)
class Module:
    """One linear of the source checkpoint (``name`` without ``.weight``), or, with ``stacked``, one
    ``[E, in, out]`` tensor holding a matrix per expert (gpt-oss's ``experts.gate_up_proj`` /
    ``experts.down_proj``; ``shape`` is then one expert's ``(out, in)``)."""

    name: str
    kind: str  # "expert", "attention", "mla", "shared", "dense", "excluded"
    layer: int | None
    shape: tuple[int, int]
    expert_role: str | None = None  # "gate" / "up" / "down" for routed experts ("gate_up" stacked)
    group: str | None = None  # the quantized_layers prefix of a routed expert: "...layers.{l}.<moe>.experts"
    stacked: int = 0  # number of experts stacked in the tensor (0: a plain linear)
    layout: str = ""  # a stack's quantized layout (STACK_LAYOUT): "gpt_oss" or "llama4"

    @property
    def tensor(self) -> str:
        """The source tensor's name."""
        return self.name if self.stacked else self.name + ".weight"

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


_NAMED_EXPERT = re.compile(r"^(.*\.layers\.(\d+)\.mlp\.experts)\.\d+\.(gate|up|down)_proj\.weight$")
_STACKED_EXPERT = re.compile(r"^.*\.layers\.(\d+)\.(?:mlp|feed_forward)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"\.(?:mlp|feed_forward)\.(gate|router)\.weight$")


def classify_by_name(src: SourceModel) -> list[Module]:
    """The linears of a DeepSeek-V3 / gpt-oss / OLMoE / Llama-4 checkpoint by their Hugging Face names:
    routed experts (``mlp.experts.{e}.{gate,up,down}_proj``, or the stacked ``experts.gate_up_proj``
    ``[E, H, 2I]`` / ``down_proj`` ``[E, I, H]`` of gpt-oss's ``mlp`` and Llama-4's ``feed_forward``),
    routers (``mlp.gate`` / ``mlp.router`` / ``feed_forward.router``: kept), shared experts
    (``mlp.shared_experts``, ``feed_forward.shared_expert``), dense MLPs (DeepSeek-V3's first layers,
    Llama-4's interleaved dense ``feed_forward``), attention (DeepSeek-V3's MLA projections: kind ``mla``,
    kept in the model dtype). Llama-4's vision tower and projector are kept (kind ``excluded``)."""
    mods = []
    for name in sorted(src.location):
        info = src.info(name)
        if name.startswith(UNQUANTIZED_TOWERS):
            if name.endswith(".weight") and len(info.shape) == 2:
                mods.append(Module(name[: -len(".weight")], "excluded", None, tuple(info.shape)))
            continue
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m else None
        st = _STACKED_EXPERT.match(name)
        if st and len(info.shape) == 3:
            e, i, o = info.shape
            role = "gate_up" if st.group(2) == "gate_up_proj" else "down"
            mods.append(Module(name, "expert", layer, (o, i), role, name.rsplit(".", 1)[0], stacked=e,
                               layout=STACK_LAYOUT.get(src.family, "gpt_oss")))
            continue
        if not name.endswith(".weight") or len(info.shape) != 2:
            continue
        mod, shape = name[: -len(".weight")], tuple(info.shape)
        ex = _NAMED_EXPERT.match(name)
        if ex:
            mods.append(Module(mod, "expert", int(ex.group(2)), shape, ex.group(3), ex.group(1)))
        elif _ROUTER.search(name) or layer is None:
            mods.append(Module(mod, "excluded", layer, shape))
        elif ".self_attn." in name:
            mods.append(Module(mod, "mla" if src.family in MLA_FAMILIES else "attention", layer, shape))
        elif ".shared_expert" in name:
            mods.append(Module(mod, "shared", layer, shape))
        else:
            mods.append(Module(mod, "dense", layer, shape))
    return mods


# A transformers MoE outside the registry and the named families, read by its Hugging Face names: routed
# experts stored one linear per expert (the per-expert names transformers writes for its fused *Experts
# modules, as hub checkpoints carry them).
_GENERIC_EXPERT = re.compile(
    r"^(.*\.layers\.(\d+)\.(?:[A-Za-z0-9_]+\.)*?experts)\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_GENERIC_ROLE = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_GENERIC_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_GENERIC_SHARED = re.compile(r"\.(?:shared_experts?|shared_mlp)\.(?:gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_GENERIC_DENSE = re.compile(r"\.layers\.\d+\.(?:mlp|feed_forward)\.(?:gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")


def classify_generic(src: SourceModel) -> list[Module]:
    """The linears of a transformers MoE outside the registry by their names, conservatively: routed experts
    (``...layers.L.<...>.experts.E.{gate,up,down}_proj`` or ``{w1,w3,w2}``), shared experts
    (``shared_expert(s)`` / ``shared_mlp``), dense MLPs (``layers.L.{mlp,feed_forward}.*``) and attention whose
    module holds exactly q/k/v/o projections; every other linear (routers, latent or linear attention,
    state-space mixers, indexers) stays in the model dtype (kind ``excluded``)."""
    weights = {n: src.info(n) for n in src.location}
    attn: dict[str, set[str]] = {}
    for name, info in weights.items():
        if name.endswith(".weight") and len(info.shape) == 2:
            parent, _, leaf = name[: -len(".weight")].rpartition(".")
            attn.setdefault(parent, set()).add(leaf)
    mods = []
    for name in sorted(weights):
        info = weights[name]
        if not name.endswith(".weight") or len(info.shape) != 2:
            continue
        mod, shape = name[: -len(".weight")], tuple(info.shape)
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m else None
        ex = _GENERIC_EXPERT.match(name)
        parent, _, leaf = mod.rpartition(".")
        if ex:
            mods.append(Module(mod, "expert", int(ex.group(2)), shape, _GENERIC_ROLE[ex.group(3)], ex.group(1)))
        elif layer is None:
            mods.append(Module(mod, "excluded", layer, shape))
        elif _GENERIC_SHARED.search(name):
            mods.append(Module(mod, "shared", layer, shape))
        elif _GENERIC_DENSE.search(name):
            mods.append(Module(mod, "dense", layer, shape))
        elif leaf in _GENERIC_ATTENTION and attn.get(parent) == set(_GENERIC_ATTENTION):
            mods.append(Module(mod, "attention", layer, shape))
        else:
            mods.append(Module(mod, "excluded", layer, shape))
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
        if m.kind in ("excluded", "mla"):
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
        # One group per distinct layer entry, numbered in the model's module order, targets sorted.
        groups: dict[str, list[str]] = {}
        for prefix in sorted(q["quantized_layers"], key=_module_order):
            entry = q["quantized_layers"][prefix]
            groups.setdefault(json.dumps(entry, sort_keys=True), []).append(prefix)
        qc["config_groups"] = {f"group_{i}": {**config_group(json.loads(k)), "targets": sorted(t)}
                               for i, (k, t) in enumerate(groups.items())}
    elif q["quant_algo"] in UNIFORM_CONFIG_GROUPS:
        qc["config_groups"] = {"group_0": {**config_group(q), "targets": ["Linear"]}}
    return hf_quant, qc


def _module_order(name: str) -> list:
    """A module name's sort key in model order (``layers.2`` before ``layers.10``)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def _collapse(excluded: Iterable[str], everything: Iterable[str]) -> list[str]:
    """Unquantized modules as ModelOpt lists them: the largest module subtree whose linears and
    embeddings are all unquantized, as ``prefix*`` (``model.layers.1*``, ``model.layers.0.self_attn*``),
    or the module's own name when that subtree is the module alone (``lm_head``, a router). Where
    ``prefix*`` would also match a quantized module (``model.layers.1*`` matches ``model.layers.10.…``
    in a model of eleven or more layers), the subtree is ``prefix.*``, as ModelOpt then writes it: the
    engines match these patterns with fnmatch."""
    excluded = set(excluded)
    leaves = set(everything)

    def ancestors(n):
        parts = n.split(".")
        # Never "model" itself; another top-level module (a multimodal model's vision tower) may collapse.
        return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if i > 1 or parts[0] != "model"]

    out = set()
    for n in excluded:
        best = n
        for a in ancestors(n):
            if all(l in excluded for l in leaves if l.startswith(a + ".")):
                best = a
            else:
                break
        if best == n:
            out.add(n)
        elif all(l in excluded for l in leaves if l.startswith(best)):
            out.add(best + "*")
        else:
            out.add(best + ".*")
    return sorted(out)


# ---- input amax ----------------------------------------------------------------------------------

def measure_input_amax(model_dir: str | Path, token_ids: list[list[int]]) -> dict[str, float]:
    """Per linear, the largest |input| seen on ``token_ids`` (the model run in its dtype with
    transformers): what ModelOpt's max calibration records. A layer's routed experts share one value
    per projection (gate/up: the layer's expert input; down: the largest intermediate any expert
    produced), as ModelOpt synchronises them for the fused kernels. Keys are module names as written
    (per expert). Holds the whole model: for the checkpoints a single host can run in transformers."""
    import transformers  # optional heavy dependency, only for this measurement

    with SourceModel(model_dir) as ck:
        mods, family, arch = ck.modules(), ck.family, (ck.hf_config.get("architectures") or [""])[0]
    # A multimodal Llama-4 loads as its own class (the causal-LM auto class would build the text model
    # alone, under other names); the tower is run on the token ids only.
    cls = getattr(transformers, arch) if family == "llama4" and hasattr(transformers, arch) \
        else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(str(model_dir), dtype="auto").eval()
    amax: dict[str, float] = {}

    def bump(key, value):
        amax[key] = max(amax.get(key, 0.0), float(value))

    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, name=name: bump(name, args[0].detach().abs().amax())))
        elif type(mod).__name__ == "Llama4TextExperts":
            # Llama-4's experts take every token for every expert, the router's sigmoid weight already
            # applied to the input (zero where an expert was not chosen): ModelOpt's quantizers of the
            # stack see exactly that input and the intermediate it gives.
            layer = int(_LAYER.search("." + name + ".").group(1))

            def on_llama4(m, args, layer=layer):
                x = args[0].detach().reshape(m.gate_up_proj.shape[0], -1, m.gate_up_proj.shape[1])
                bump(("experts_in", layer), x.abs().amax())
                gate, up = torch.bmm(x, m.gate_up_proj).chunk(2, dim=-1)
                bump(("experts_mid", layer), (up * m.act_fn(gate)).detach().abs().amax())
            hooks.append(mod.register_forward_pre_hook(on_llama4))
        elif type(mod).__name__.endswith("Experts") and expert_input_weight(mod)[0] is not None:
            # The seam's experts, gated or not (Nemotron-H: act(x @ up) @ down).
            layer = int(_LAYER.search("." + name + ".").group(1))

            def on_experts(m, args, kwargs, layer=layer):
                x, idx = (args + tuple(kwargs.values()))[:2]
                bump(("experts_in", layer), x.detach().abs().amax())
                w, gated = expert_input_weight(m)
                for e in range(w.shape[0]):
                    rows = (idx == e).any(-1)
                    if rows.any():
                        h = torch.nn.functional.linear(x[rows], w[e])
                        if gated:
                            gate, up = h.chunk(2, dim=-1)
                            mid = m.act_fn(gate) * up
                        else:
                            mid = m.act_fn(h)
                        bump(("experts_mid", layer), mid.detach().abs().amax())
            hooks.append(mod.register_forward_pre_hook(on_experts, with_kwargs=True))
    try:
        with torch.no_grad():
            for row in token_ids:
                model(input_ids=torch.tensor([row]))
    except Exception as e:  # noqa: BLE001 - transformers' own modelling code failed: one line naming it
        first = (str(e).splitlines() or [""])[0][:300]
        raise InputError(f"transformers' forward of {arch or 'this model'} failed while the input amax was measured "
                         f"({type(e).__name__}: {first})", where=str(model_dir),
                         hint="a weight-only format needs no input amax") from None
    finally:
        for h in hooks:
            h.remove()
    from transformers.conversion_mapping import get_model_conversion_mapping

    loaded = loaded_name(get_model_conversion_mapping(model))  # hub names -> the module names measured

    def runtime_name(n: str) -> str:
        key = loaded(n + ".weight")
        return key[:-len(".weight")] if key.endswith(".weight") else n
    out = {}
    for m in mods:
        if m.kind == "expert":
            key = ("experts_mid" if m.expert_role == "down" else "experts_in", m.layer)
            if key in amax:
                out[m.name] = amax[key]
        else:
            hf_name = m.name if m.name in amax else runtime_name(m.name)
            if hf_name in amax:
                out[m.name] = amax[hf_name]
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


# gpt-oss's release describes its MXFP4 experts in config.json (Hugging Face's ``mxfp4`` method), and its
# loaders (TensorRT-LLM modeling_gpt_oss.py, vLLM mxfp4.py) read them from there: these modules stay BF16.
GPT_OSS_MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _module_specs(m: Module, f: UnifiedFormat, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple]]:
    """The tensors module ``m`` is written as in format ``f``. A stacked gpt-oss expert tensor keeps its
    release's names: BF16 ``[E, in, out]`` as is, MXFP4 as ``{name}_blocks`` uint8 ``[E, out, in/32, 16]``
    (the format's packed bytes, 16 per block) and ``{name}_scales`` uint8 ``[E, out, in/32]``."""
    if not m.stacked:
        return f.tensor_specs(m.name, *m.shape, dtype)
    (out_f, in_f), e = m.shape, m.stacked
    if f.quant_algo is None:
        return [(m.name, dtype, (e, in_f, out_f))]
    if m.layout == "llama4":
        return _llama4_stack_specs(m, f, dtype)
    specs = dict((s, (dt, shape)) for s, dt, shape in f.fmt.modelopt_tensor_specs(out_f, in_f, dtype))
    if f.name != "mxfp4" or set(specs) != {"weight", "weight_scale"}:
        raise UnsupportedError(f"{m.name}: gpt-oss's experts are read as BF16 or MXFP4 only, not {f.label}",
                               hint="export gpt-oss with '*=mxfp4' or unquantized")
    nb = specs["weight_scale"][1][-1]
    return [(m.name + "_blocks", torch.uint8, (e, out_f, nb, in_f // 2 // nb)),
            (m.name + "_scales", torch.uint8, (e, out_f, nb))]


def expert_layer_bits(src: "SourceModel", formats: Iterable[str], dtype: torch.dtype | None = None
                      ) -> dict[int, dict[str, int]]:
    """Stored bits of each MoE layer's routed experts per format, as this writer stores them (every
    tensor of the expert linears, scales, pre-quant scales and input scales included): MoE layer ->
    format -> bits. ``formats`` are trtmoe names (a float alias counts the unquantized tensors in
    ``dtype``, default the experts' own); a format with a shape problem in a layer is left out there."""
    mods = [m for m in src.modules() if m.kind == "expert"]
    if dtype is None:
        dtype = src.info(mods[0].tensor).dtype if mods else torch.bfloat16
    out: dict[int, dict[str, int]] = {}
    for name in formats:
        f = get_format(name)
        for m in mods:
            row = out.setdefault(m.layer, {})
            if row.get(name, 0) is None:
                continue
            try:
                if f.quant_algo and f.shape_problem(*m.shape):
                    raise UnsupportedError(f.shape_problem(*m.shape))
                specs = _module_specs(m, f, dtype)
            except UnsupportedError:  # not writable there (shape, or a stack layout without this format)
                row[name] = None
                continue
            row[name] = row.get(name, 0) + sum(8 * math.prod(shape) * dt.itemsize for _, dt, shape in specs)
    return {l: {n: b for n, b in row.items() if b is not None} for l, row in out.items()}


def _llama4_stack_name(m: Module, suffix: str) -> str:
    """A Llama-4 expert stack's tensor for a format tensor ``suffix``: the packed weight keeps the stack's
    name (``...experts.gate_up_proj``), the rest join it with ``_`` (``gate_up_proj_weight_scale``)."""
    return m.name if suffix == "weight" else f"{m.name}_{suffix}"


def _llama4_stack_specs(m: Module, f: UnifiedFormat, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple]]:
    """Llama-4's expert stack as ModelOpt 0.47 exports it: every per-matrix tensor of the format (an
    ``[out, in]``-oriented one) stacked over the experts in the source's ``[E, in, out]`` orientation (NVFP4:
    packed bytes ``[E, in/2, out]``, block scales ``[E, in/16, out]``), and one per-tensor scale
    (``weight_scale`` of FP8, ``weight_scale_2``, ``input_scale``) for the whole stack, gate and up together."""
    if f.name not in LLAMA4_EXPERT_FORMATS:
        raise UnsupportedError(f"{m.name}: Llama-4's stacked experts are written as BF16, FP8, NVFP4 or NVFP4 W4A16 "
                               f"only, not {f.label}",
                               hint="choose fp8, nvfp4 or nvfp4_w4a16 for Llama-4's routed experts")
    (out_f, in_f), e = m.shape, m.stacked
    out = []
    for s, dt, shape in f.fmt.modelopt_tensor_specs(out_f, in_f, dtype):
        if len(shape) == 2:
            shape = (e, shape[1], shape[0])
        elif len(shape) != 0:
            raise UnsupportedError(f"{m.name}: {f.label}'s {s} has no stacked Llama-4 form")
        out.append((_llama4_stack_name(m, s), dt, tuple(shape)))
    return out


def _llama4_stack_tensors(m: Module, f: UnifiedFormat, src: Tensor, input_amax: float | None) -> dict[str, Tensor]:
    """The tensors of :func:`_llama4_stack_specs`: each expert's ``[out, in]`` matrix quantized by the format
    with the stack's own amax behind the per-tensor scale, its 2-D tensors transposed back and stacked."""
    stack_amax = src.abs().amax().float()
    # ModelOpt divides a stacked FP8 weight by its scale in float32 (the scale broadcast as a 1-element
    # tensor promotes the quotient), where a single linear's quotient is rounded to the model dtype first.
    qdtype = torch.float32 if f.name == "fp8" else src.dtype
    per = [f.fmt.modelopt_export(src[x].transpose(0, 1).contiguous(), dtype=qdtype, input_amax=input_amax,
                                 weight_amax=stack_amax) for x in range(m.stacked)]
    out = {}
    for s in per[0]:
        name = _llama4_stack_name(m, s)
        if per[0][s].dim() == 2:
            out[name] = torch.stack([p[s].transpose(0, 1) for p in per])
        else:
            if any(not torch.equal(p[s], per[0][s]) for p in per):
                raise CheckpointError(f"{m.name}: the experts' {s} differ; one per stack is written")
            out[name] = per[0][s]
    return out


def _module_tensors(m: Module, f: UnifiedFormat, src: Tensor, input_amax: float | None,
                    weight_amax: Tensor | None) -> dict[str, Tensor]:
    """Full tensor name -> tensor for module ``m`` (``src``: its source tensor in the model dtype)."""
    if not m.stacked:
        return {f"{m.name}.{k}": t for k, t in f.quantize(src, input_amax, weight_amax).items()}
    if f.quant_algo is None:
        return {m.name: src}
    if m.layout == "llama4":
        return _llama4_stack_tensors(m, f, src, input_amax)
    per = [f.quantize(src[e].transpose(0, 1).contiguous()) for e in range(m.stacked)]  # each [out, in]
    return {m.name + "_blocks": torch.stack([p["weight"] for p in per]),
            m.name + "_scales": torch.stack([p["weight_scale"] for p in per])}


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.[^.]+$")


def _expert_of(m: Module) -> tuple[int, int, str] | None:
    """(layer, expert, role) of a routed expert's own linear (``...experts.{e}.{w1|up_proj|...}``)."""
    hit = _EXPERT_INDEX.search(m.name)
    if m.kind != "expert" or m.stacked or hit is None or m.layer is None or m.expert_role not in awq.EXPERT_ROLES:
        return None
    return m.layer, int(hit.group(1)), m.expert_role


def _expert_tensor_names(mods: list[Module]) -> dict[tuple[int, int, str], str]:
    """(layer, expert, role) -> source tensor name of every routed expert's own linear."""
    return {where: m.tensor for m in mods if (where := _expert_of(m)) is not None}


def _check_family_rules(family: str, mods: list[Module], plan: UnifiedPlan) -> None:
    """What an architecture's loaders read regardless of the format cell: DeepSeek-V3's MLA projections
    stay in the model dtype; gpt-oss takes one expert format (BF16 or MXFP4) and BF16 elsewhere."""
    if family in MLA_FAMILIES and plan.meta.get("policy") != "uniform":
        attn = get_format(plan.other_formats.get("attention", "bf16"))
        if attn.quant_algo:
            name = {"deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3"}[family]
            raise UnsupportedError(f"{name} x attention (MLA) x {attn.label}: refused: its MLA projections stay "
                                   "in the model dtype (no support cell quantizes them)",
                                   hint="quantize the routed experts, shared experts and dense MLPs only")
    if family in LLAMA4_FAMILIES:
        bad = sorted({plan.format_of(m).name for m in mods if m.kind == "expert"} - set(LLAMA4_EXPERT_FORMATS))
        if bad:
            raise UnsupportedError(f"Llama-4 x routed experts x {get_format(bad[0]).label}: refused: its stacked experts "
                                   "are written as ModelOpt 0.47 writes them, in BF16, FP8, NVFP4 or NVFP4 W4A16",
                                   hint="choose fp8, nvfp4 or nvfp4_w4a16 for Llama-4's routed experts")
    if family == "gpt_oss":
        expert = {plan.format_of(m).name for m in mods if m.kind == "expert"}
        other = {plan.format_of(m).name for m in mods if m.kind != "expert"}
        if len(expert) > 1 or other - {"bf16"}:
            raise UnsupportedError("gpt-oss x per-layer / non-expert formats: refused: its loaders take one expert "
                                   "format for the whole model (BF16 or MXFP4) and BF16 attention",
                                   hint="export gpt-oss with '*=mxfp4' (experts only) or unquantized")


def write_unified_checkpoint(model: str | Path, out: str | Path, plan: UnifiedPlan, *, target: str = "trtllm-pytorch",
                             input_amax: dict[str, float] | None = None, force: bool = False,
                             shard_bytes: int = SHARD_BYTES, dtype: torch.dtype | None = None,
                             progress: Callable[[int, int], None] | None = None,
                             extra_manifest: dict | None = None, rounding=None, fp_rounding=None) -> UnifiedResult:
    """Write ``model`` (an HF MoE checkpoint directory) as a unified-HF checkpoint in ``out``, atomically.

    ``plan`` gives each linear its format; ``input_amax`` (module name -> amax) is needed for formats that
    quantize activations. Tensors that stay unquantized are written in ``dtype`` (default: the source's
    dtype). Streams one linear at a time. ``rounding`` (``trtmoe.quant.awq.checkpoint_rounding`` of a
    calibration, in ``dtype``) gives the routed experts of a format with an activation-aware search
    (W4A8 AWQ) the pre-quant scale and clip the calibration searched; ``fp_rounding`` (a
    ``unified_rounding.UnifiedRounding``) chooses the routed experts' FP8 / FP8-block / NVFP4 / MXFP4
    codes activation-aware (None: round to nearest)."""
    input_amax = input_amax or {}
    ck = SourceModel(model)
    try:
        mods = ck.modules()
        if plan.meta.get("policy") == "uniform" and ck.family == "gpt_oss":  # '*=F' means the experts there
            plan = UnifiedPlan(plan.expert_formats, {}, plan.meta)
        _check_family_rules(ck.family, mods, plan)
        linear_names = {m.tensor for m in mods}
        src_dtype = ck.info(mods[0].tensor).dtype if mods else torch.bfloat16
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
            entries.append((m, _module_specs(m, f, dtype)))
        for name in sorted(ck.location):
            if name not in linear_names:  # norms, biases, 1-D tensors: copied in the model dtype
                info = ck.info(name)
                keep = info.dtype if not info.dtype.is_floating_point else dtype
                if name.endswith(FLOAT32_TENSORS):
                    keep = torch.float32
                entries.append((None, [(name, keep, tuple(info.shape))]))
        entries.sort(key=lambda e: e[1][0][0])
        shards = _shards(entries, shard_bytes)
        total = sum(math.prod(s) * dt.itemsize for _, specs in entries for _, dt, s in specs)
        cfg = json.loads((ck.path / "config.json").read_text())
        if ck.family == "gpt_oss":
            # No hf_quant_config.json: the loaders would take it over config.json's own description.
            mxfp4 = any(plan.format_of(m).quant_algo for m in mods)
            hf_quant = None
            quant_algo = "W4A16_MXFP4" if mxfp4 else None
            cfg.pop("quantization_config", None)
            if mxfp4:
                cfg["quantization_config"] = json.loads(json.dumps(GPT_OSS_MXFP4_CONFIG))
        else:
            hf_quant, qc = quant_configs(mods, plan)
            quant_algo = hf_quant["quantization"]["quant_algo"]
            cfg["quantization_config"] = qc
        by_fusion: dict[str, list[Module]] = {}
        for m in mods:
            if m.fusion:
                by_fusion.setdefault(m.fusion, []).append(m)
        amax_cache: dict[str, Tensor] = {}
        expert_tensor = _expert_tensor_names(mods)

        def read_expert(layer: int, e: int, role: str) -> Tensor:
            return ck.read(expert_tensor[(layer, e, role)]).to(dtype)

        def fused_amax(key: str) -> Tensor:
            """The largest |w| over a fused group (read member by member; the last group is cached)."""
            if key not in amax_cache:
                amax_cache.clear()
                amax_cache[key] = torch.stack([ck.read(m.tensor).to(dtype).abs().amax().float()
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
                        src = ck.read(mod.tensor).to(dtype)
                        shared = None
                        if f.quant_algo and mod.fusion and f.shares_amax(mod.kind):
                            shared = fused_amax(mod.fusion)
                        packed = None
                        where = _expert_of(mod) if rounding is not None else None
                        if where is not None and all((where[0], where[1], r) in expert_tensor
                                                     for r in awq.EXPERT_ROLES):
                            got = awq.w4a8_expert_tensors(rounding, f.fmt, *where,
                                                          lambda e, r, l=where[0]: read_expert(l, e, r))
                            packed = None if got is None else {f"{mod.name}.{k}": t for k, t in got.items()}
                        if packed is None and fp_rounding is not None and f.quant_algo:
                            packed = fp_rounding.quantize(mod, f.fmt, src, input_amax.get(mod.name), shared, ck)
                            packed = None if packed is None else {f"{mod.name}.{k}": t for k, t in packed.items()}
                        if packed is None:
                            packed = _module_tensors(mod, f, src, input_amax.get(mod.name), shared)
                        for tname, dt, shape in ss:
                            w.write(packed[tname].to(dt).reshape(shape).contiguous())
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
            if hf_quant is not None:
                (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4, sort_keys=True) + "\n")
            for fn in COPIED_FILES:
                if (ck.path / fn).is_file():
                    shutil.copyfile(ck.path / fn, tmp / fn)
            manifest = write_manifest(
                tmp, kind=KIND, file_hashes=hashes, target=target, source=str(ck.path),
                architecture=ck.family, trtmoe_version=__version__,
                plan={"expert_formats": {str(k): v for k, v in sorted(plan.expert_formats.items())},
                      "other_formats": dict(plan.other_formats), **plan.meta},
                quant_algo=quant_algo, **(extra_manifest or {}))
        files = sorted(hashes)
        return UnifiedResult(Path(out), total, files, hf_quant or {"quantization": {"quant_algo": quant_algo}},
                             plan, manifest)
    finally:
        ck.close()


# ---- reading one back ----------------------------------------------------------------------------

def read_layer_formats(ckpt: str | Path) -> dict[str, UnifiedFormat]:
    """Module prefix -> format, from a unified-HF checkpoint's ``hf_quant_config.json``
    (``{"*": fmt}`` for a uniform one). A gpt-oss checkpoint (no ``hf_quant_config.json``) says MXFP4
    experts in its ``config.json``."""
    if not (Path(ckpt) / "hf_quant_config.json").is_file():
        qc = json.loads((Path(ckpt) / "config.json").read_text()).get("quantization_config") or {}
        return {"*": FORMATS["mxfp4" if qc.get("quant_method") == "mxfp4" else "bf16"]}
    q = json.loads((Path(ckpt) / "hf_quant_config.json").read_text())["quantization"]
    if q.get("quant_algo") == "MIXED_PRECISION":
        return {p: format_for_algo(e["quant_algo"]) for p, e in q["quantized_layers"].items()}
    return {"*": format_for_algo(q.get("quant_algo"))}
