"""What each TensorRT-LLM release line can build: one versioned support table.

A *cell* is (release line × architecture × expert format × layout) for quantization, or
(release line × architecture × mapping feature) for parallelism. Each cell is

* ``supported``: TensorRT-LLM's model code declares exactly what trtmoe writes, and NVIDIA's own
  examples list the combination;
* ``unlisted``: the model code declares what trtmoe writes, but NVIDIA's support matrices do not
  list the combination (accepted, with a caution printed wherever the cell is consulted);
* ``refused``: ``trtllm-build`` would fail or would declare other parameters than the checkpoint
  holds. The reason says what the source does.

``convert --target tensorrt-llm`` (and its allocator's candidate formats), ``build``'s preflight,
``build --dry-run`` and ``inspect`` all ask :func:`check` / :func:`options`; the README's table is
:func:`markdown_table`. The facts were read from TensorRT-LLM's source (1.x line):
``models/modeling_utils.py`` (``PretrainedConfig.to_layer_quant_config``, ``LayerQuantConfig``,
``preprocess_weights``), ``quantization/quantize.py`` (``quantize``, ``quantize_layers``,
``weight_only_groupwise_quantize``), ``layers/moe.py`` (``MixtureOfExperts``, ``SharedMoE``,
``MOEWeightWrapper``), the model classes of ``models/llama`` (Mixtral), ``models/qwen``, ``models/deepseek_v1`` and
``models/phi3`` (Phi-3.5-MoE), the MoE plugin and its CUTLASS dispatch, and the support matrix of
``examples/models/core/qwen/README.md`` and ``examples/models/core/phi/README.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnsupportedError
from ..hf.adapters import ADAPTERS, adapter_for_checkpoint
from ..parallel.mapping import Mapping
from ..quant.formats import FORMATS as QUANT_FORMATS
from ..quant.formats import QUANTIZED
from ..quant import FLOAT_NAMES
from .schema import schema_for

SUPPORTED, UNLISTED, REFUSED = "supported", "unlisted", "refused"

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v1", "phimoe")
ARCH_LABEL = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE",
              "deepseek_v1": "DeepSeek-MoE v1", "phimoe": "Phi-3.5-MoE"}
# The TensorRT-LLM class name each row is about: the architecture registry's.
TRTLLM_ARCHITECTURE = {fam: ADAPTERS[fam].trtllm_architecture for fam in FAMILIES}

# Expert storage formats (trtmoe names) and what a TensorRT-LLM checkpoint calls them: the formats'
# own facts. A new format needs its row of cells below (a test checks every format has them).
FORMATS = ("float", *QUANTIZED)
FORMAT_LABEL = {"float": QUANT_FORMATS["fp16"].trtllm_label, **{f: QUANT_FORMATS[f].trtllm_label for f in QUANTIZED}}
FORMAT_ALGO = {"float": None, **{f: QUANT_FORMATS[f].trtllm_quant_algo for f in QUANTIZED}}
LAYOUTS = ("uniform", "mixed")  # one quant_algo for every MoE layer / MIXED_PRECISION + quant_cfg.json
FEATURES = ("tp", "moe_tp", "moe_ep", "pp")
_FLOAT_ALIASES = set(FLOAT_NAMES)


@dataclass(frozen=True)
class Cell:
    status: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status != REFUSED


# ---- the facts, per release line -----------------------------------------------------------------
# Why each refused / unlisted cell is what it is (restated from the source, not quoted).
_SHARED_MOE_AWQ = ("its routed experts live in a SharedMoE layer, and TensorRT-LLM's group-wise quantization "
                   "re-creates every MoE module as type(module) with group_size / pre_quant_scale / zero / "
                   "use_w4a8_awq / use_int8_weight arguments, which SharedMoE.__init__ does not take (TypeError "
                   "in quantize_layers); NVIDIA's Qwen support matrix marks AWQ unsupported for Qwen MoE")
_NO_MIXED = ("PretrainedConfig.to_layer_quant_config adds the per-MoE-module quant_cfg.json entry only for "
             "MixtralForCausalLM; for {arch} the MoE layer matches no entry and keeps the quant mode it was "
             "built with, the union of every layer's mode, so its declared weights differ from the checkpoint's")
_MIXED_FLOAT = ("a float MoE layer gets no quant_cfg.json entry, so TensorRT-LLM leaves it declared in the union "
                "of the quantized layers' modes (it expects per_channel_scale / group scales and quantized "
                "shapes); an entry with quant_algo null is skipped the same way")
_PER_EXPERT = ("TensorRT-LLM's fused MoE (MOEWeightWrapper) stacks every expert of a layer in one format; "
               "per-expert tensors are trtmoe's embedded-engine layout")
_G64 = ("the MoE plugin hands the group size to its fine-grained CUTLASS grouped GEMM (64 is one whole K tile), "
        "but NVIDIA's MoE examples only use group size 128")
_QWEN3_WO = ("the QWen model builds Qwen3-MoE with the plain MOE class, which takes every weight-only argument, "
             "but NVIDIA's Qwen support matrix lists no weight-only or AWQ build for Qwen3 MoE")
_PHIMOE_WO = ("TensorRT-LLM's phi3 model builds PhiMoEForCausalLM with the plain MOE class (as Mixtral), which "
              "takes every weight-only and group-wise argument, but NVIDIA's Phi support matrix lists only "
              "FP16/BF16, FP8 and INT8 SmoothQuant for Phi-3.5-MoE")
_DEEPSEEK_WO = ("SharedMoE is re-created with quant_mode only for per-channel weight-only, which it takes, but "
                "NVIDIA lists no weight-only build for DeepSeek-MoE v1")


_FUSED_MOE_ONLY = ("this format is run by TensorRT-LLM's PyTorch-backend fused MoE from a ModelOpt unified-HF "
                   "checkpoint; the engine path (trtllm-build) has no MoE build of it")


def _quant_cells_1_2() -> dict[tuple[str, str, str], Cell]:
    cells: dict[tuple[str, str, str], Cell] = {}
    uniform = {
        "mixtral": {"float": Cell(SUPPORTED), "int8": Cell(SUPPORTED), "int4": Cell(SUPPORTED),
                    "int4_g128": Cell(SUPPORTED), "int4_g64": Cell(UNLISTED, _G64)},
        "qwen2_moe": {"float": Cell(SUPPORTED), "int8": Cell(SUPPORTED), "int4": Cell(SUPPORTED),
                      "int4_g128": Cell(REFUSED, _SHARED_MOE_AWQ), "int4_g64": Cell(REFUSED, _SHARED_MOE_AWQ)},
        "qwen3_moe": {"float": Cell(SUPPORTED), "int8": Cell(UNLISTED, _QWEN3_WO),
                      "int4": Cell(UNLISTED, _QWEN3_WO), "int4_g128": Cell(UNLISTED, _QWEN3_WO),
                      "int4_g64": Cell(UNLISTED, _QWEN3_WO + "; " + _G64)},
        "deepseek_v1": {"float": Cell(SUPPORTED), "int8": Cell(UNLISTED, _DEEPSEEK_WO),
                        "int4": Cell(UNLISTED, _DEEPSEEK_WO),
                        "int4_g128": Cell(REFUSED, _SHARED_MOE_AWQ.replace(
                            "; NVIDIA's Qwen support matrix marks AWQ unsupported for Qwen MoE", "")),
                        "int4_g64": Cell(REFUSED, _SHARED_MOE_AWQ.replace(
                            "; NVIDIA's Qwen support matrix marks AWQ unsupported for Qwen MoE", ""))},
        "phimoe": {"float": Cell(SUPPORTED), "int8": Cell(UNLISTED, _PHIMOE_WO), "int4": Cell(UNLISTED, _PHIMOE_WO),
                   "int4_g128": Cell(UNLISTED, _PHIMOE_WO), "int4_g64": Cell(UNLISTED, _PHIMOE_WO + "; " + _G64)},
    }
    # The fused-MoE formats (FP8, FP8 blocks, NVFP4, MXFP4, W4A8 AWQ) are stored with ModelOpt's
    # unified-HF tensor names, which the engine path's converters do not read.
    for fam, row in uniform.items():
        for fmt in QUANTIZED:
            if not QUANT_FORMATS[fmt].engine_path:
                row[fmt] = Cell(REFUSED, _FUSED_MOE_ONLY)
        for fmt, cell in row.items():
            cells[(fam, fmt, "uniform")] = cell
            if fam != "mixtral":
                mixed = Cell(REFUSED, _NO_MIXED.format(arch=TRTLLM_ARCHITECTURE[fam]))
            elif fmt == "float":
                mixed = Cell(REFUSED, _MIXED_FLOAT)
            else:
                mixed = cell
            cells[(fam, fmt, "mixed")] = mixed
    return cells


_EP_QWEN2 = ("the QWen converter takes --moe_ep_size and MixtureOfExperts splits experts by moe_ep, but NVIDIA's "
             "Qwen support matrix marks EP unsupported for Qwen1.5-MoE / Qwen2-57B-A14B")
_PP_QWEN3 = "NVIDIA's Qwen support matrix marks PP unsupported for Qwen3 MoE (TP and EP are listed)"
_PP_PHIMOE = ("the phi3 model splits its decoder layers by pp like every decoder model, but NVIDIA's Phi support "
              "matrix lists TP only (and its README expert parallelism via --moe_tp_size / --moe_ep_size)")
_DEEPSEEK_PAR = "NVIDIA lists no {what} build for DeepSeek-MoE v1; its model class shards experts like every MoE"


def _mapping_cells_1_2() -> dict[tuple[str, str], Cell]:
    c = {(fam, "tp"): Cell(SUPPORTED) for fam in FAMILIES}
    c.update({(fam, "moe_tp"): Cell(SUPPORTED) for fam in FAMILIES})
    c.update({("mixtral", "moe_ep"): Cell(SUPPORTED), ("qwen2_moe", "moe_ep"): Cell(UNLISTED, _EP_QWEN2),
              ("qwen3_moe", "moe_ep"): Cell(SUPPORTED),
              ("deepseek_v1", "moe_ep"): Cell(UNLISTED, _DEEPSEEK_PAR.format(what="expert-parallel")),
              ("mixtral", "pp"): Cell(SUPPORTED), ("qwen2_moe", "pp"): Cell(SUPPORTED),
              ("qwen3_moe", "pp"): Cell(UNLISTED, _PP_QWEN3),
              ("deepseek_v1", "pp"): Cell(UNLISTED, _DEEPSEEK_PAR.format(what="pipeline-parallel")),
              ("phimoe", "moe_ep"): Cell(SUPPORTED), ("phimoe", "pp"): Cell(UNLISTED, _PP_PHIMOE)})
    return c


@dataclass(frozen=True)
class ModelShape:
    """Which decoder-layer shapes an architecture's TensorRT-LLM model class builds."""

    dense_layers: str = "any"  # "none": every decoder layer MoE; "first": exactly layer 0 dense; "any"
    reason: str = ""  # why dense_layers is not "any"
    shared_experts_required: str = ""  # why a model without shared experts cannot be built ("" = it can)


def _model_shapes_1_2() -> dict[str, ModelShape]:
    qwen = ModelShape("none", "its QWen model makes every decoder layer MoE (mlp_only_layers / decoder_sparse_step "
                              "are not read)")
    return {"mixtral": ModelShape(), "phimoe": ModelShape(), "qwen2_moe": qwen, "qwen3_moe": qwen,
            "deepseek_v1": ModelShape("first", "its DeepSeek-V1 model hard-codes exactly layer 0 as the dense layer",
                                      "its DeepSeek-V1 decoder layer builds a MoE layer without shared experts from a "
                                      "class its model file does not import (NameError at build); only SharedMoE "
                                      "layers build")}


@dataclass(frozen=True)
class ReleaseSupport:
    """The support table of one TensorRT-LLM release line."""

    line: str
    quant: dict[tuple[str, str, str], Cell]
    mapping: dict[tuple[str, str], Cell]
    model: dict[str, ModelShape] = field(default_factory=dict)
    sources: tuple[str, ...] = field(default=())


SUPPORT: dict[str, ReleaseSupport] = {
    "1.2": ReleaseSupport("1.2", _quant_cells_1_2(), _mapping_cells_1_2(), _model_shapes_1_2(), sources=(
        "tensorrt_llm/models/modeling_utils.py", "tensorrt_llm/quantization/quantize.py",
        "tensorrt_llm/layers/moe.py", "tensorrt_llm/models/qwen/model.py",
        "tensorrt_llm/models/deepseek_v1/model.py", "tensorrt_llm/models/llama/model.py",
        "tensorrt_llm/models/phi3/model.py", "examples/models/core/phi/README.md",
        "cpp/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_template_dispatch.h",
        "examples/models/core/qwen/README.md", "examples/models/core/mixtral/README.md")),
}


def release_support(version: str) -> ReleaseSupport:
    """The table for a release line ('1.2') or release ('1.2.1'); unknown lines raise UnsupportedError."""
    schema_for(version)  # the same refusal for an unknown release line as the config schema's
    return SUPPORT[".".join(str(version).split(".")[:2])]


def canonical_format(name: str) -> str:
    return "float" if name in _FLOAT_ALIASES else name


def quant_cell(version: str, family: str, fmt: str, layout: str) -> Cell:
    return release_support(version).quant[(family, canonical_format(fmt), layout)]


def mapping_cell(version: str, family: str, feature: str) -> Cell:
    return release_support(version).mapping[(family, feature)]


def _labels(fmts) -> str:
    fmts = list(fmts)
    lab = [f"{FORMAT_LABEL[f]} ({f})" if f != "float" else "float" for f in fmts]
    return " or ".join(lab) if len(lab) <= 2 else ", ".join(lab[:-1]) + " or " + lab[-1]


@dataclass(frozen=True)
class Options:
    """What one architecture can have on one release line, for the allocator."""

    family: str
    line: str
    uniform: tuple[str, ...]  # formats one quant_algo may name for every MoE layer
    mixed: tuple[str, ...]  # formats a MIXED_PRECISION layer may have (empty: no MIXED for this cell)

    @property
    def has_mixed(self) -> bool:
        return bool(self.mixed)


def options(version: str, family: str) -> Options:
    """Formats the target accepts for ``family``: per uniform checkpoint and per MIXED_PRECISION layer."""
    rs = release_support(version)
    uni = tuple(f for f in FORMATS if rs.quant[(family, f, "uniform")].ok)
    mixed = tuple(f for f in FORMATS if rs.quant[(family, f, "mixed")].ok)
    return Options(family, rs.line, uni, mixed)


def what_works(version: str, family: str) -> str:
    """One phrase: the quantization a family can have on a release line."""
    o = options(version, family)
    quantized = [f for f in o.uniform if f != "float"]
    s = f"{_labels(quantized)} per MoE layer" if quantized else "float experts only"
    if o.has_mixed:
        s += ", MIXED_PRECISION of " + _labels(o.mixed)
    else:
        s += " (one format for every MoE layer: no MIXED_PRECISION)"
    return s


# ---- checking a concrete checkpoint --------------------------------------------------------------
@dataclass
class Verdict:
    """The cells a checkpoint touches: refusals (each one line) and cautions for unlisted cells."""

    cells: list[dict] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    cautions: list[str] = field(default_factory=list)
    hint: str | None = None
    hints: dict[str, str] = field(default_factory=dict)  # per stage: "convert" / "build"

    @property
    def ok(self) -> bool:
        return not self.refusals

    def raise_if_refused(self, where: str | None = None, *, stage: str = "convert") -> None:
        """Raise UnsupportedError with the first refusal; the hint says what ``stage`` ("convert" or
        "build") can do instead."""
        if self.refusals:
            raise UnsupportedError(self.refusals[0] + (f" (and {len(self.refusals) - 1} more)"
                                                       if len(self.refusals) > 1 else ""),
                                   where=where, hint=self.hints.get(stage, self.hint))

    def to_dict(self) -> dict:
        return {"ok": self.ok, "cells": self.cells, "refusals": self.refusals, "cautions": self.cautions}


def check(version: str, family: str, *, layer_formats: dict[int, str] | None, per_expert: bool | str = False,
          tp: int = 1, pp: int = 1, moe_tp: int = 1, moe_ep: int = 1,
          moe_layers: list[bool] | tuple[bool, ...] = (), shared_expert_size: int | None = None) -> Verdict:
    """Every cell a checkpoint touches on TensorRT-LLM ``version``.

    ``layer_formats`` maps each MoE layer to its format ("float" for unquantized; None or empty for a
    float checkpoint); ``per_expert`` is trtmoe's per-expert tensor layout (true, or the trtmoe
    granularity that produced it: "expert" / "matrix"). ``moe_layers[l]`` says
    which decoder layers have routed experts (dense layers are checked against what the model class
    builds); ``shared_expert_size`` is the MoE layers' shared-expert width (0: none; None: not known).
    Never raises for refused cells: the caller decides (see ``Verdict.raise_if_refused``)."""
    rs = release_support(version)
    arch = ARCH_LABEL[family]
    head = f"{arch} on TensorRT-LLM {rs.line}"
    v = Verdict()
    fmts = {l: canonical_format(f) for l, f in (layer_formats or {}).items()}
    used = sorted(set(fmts.values()) or {"float"}, key=FORMATS.index)
    quantized = any(f != "float" for f in used)
    mixed = len(used) > 1
    layout = "mixed" if mixed else "uniform"

    def add(kind, key, cell, label):
        v.cells.append({"kind": kind, "key": list(key), "status": cell.status, "reason": cell.reason})
        if cell.status == REFUSED:
            works = f"; what builds: {what_works(version, family)}" if kind in ("quant", "combo") else ""
            v.refusals.append(f"{head}: {label} cannot be built: {cell.reason}{works}")
        elif cell.status == UNLISTED:
            v.cautions.append(f"{head}: {label} is not in NVIDIA's support lists ({cell.reason})")

    if per_expert:
        gran = f" (trtmoe granularity '{per_expert}')" if isinstance(per_expert, str) else ""
        add("quant", (family, "per-expert", "per-expert"), Cell(REFUSED, _PER_EXPERT),
            f"experts quantized per expert{gran}")
    else:
        for f in used:
            label = (f"MIXED_PRECISION with {'float' if f == 'float' else FORMAT_LABEL[f]} MoE layers" if mixed
                     else f"{FORMAT_LABEL[f]} experts" if f != "float" else "float experts")
            add("quant", (family, f, layout), rs.quant[(family, f, layout)], label)
    for feat, size in (("tp", tp), ("moe_tp", moe_tp), ("moe_ep", moe_ep), ("pp", pp)):
        if size > 1:
            add("mapping", (family, feat), rs.mapping[(family, feat)], f"{feat}={size}")
    dense = [l for l, moe in enumerate(moe_layers) if not moe]
    shape = rs.model[family]
    if shape.dense_layers == "none" and dense:
        add("model", (family, "dense_layers"), Cell(REFUSED, (
            f"{shape.reason} and would not load the dense layers {dense}")), "a model with dense layers")
    if shape.dense_layers == "first" and moe_layers and dense != [0]:
        add("model", (family, "dense_layers"), Cell(REFUSED, (
            f"{shape.reason}, but this model has dense layers {dense}")), "this layer pattern")
    if shape.shared_experts_required and shared_expert_size == 0:
        add("model", (family, "no_shared_experts"), Cell(REFUSED, shape.shared_experts_required),
            "a model without shared experts")
    if pp > 1 and mixed and not per_expert:
        add("combo", (family, "mixed", "pp"), Cell(REFUSED, (
            "quant_cfg.json is one file for every rank and is matched against each rank's module names, which "
            "number layers from 0 on every pipeline stage")), f"MIXED_PRECISION with pp={pp}")
    if pp > 1 and quantized and dense and not mixed and not per_expert:
        add("combo", (family, "exclude_modules", "pp"), Cell(REFUSED, (
            "exclude_modules names dense layers by their global index, but each pipeline stage numbers its "
            "layers from 0")), f"quantized experts with dense layers and pp={pp}")
    if v.refusals:
        if per_expert:
            v.hints = {"convert": "use layer granularity (the default for --target tensorrt-llm), or --target "
                                  "embedded (the embedded engine runs every cell)",
                       "build": "reconvert with layer granularity: trtmoe convert MODEL -o CKPT ... --target "
                                "tensorrt-llm; or build this one with --backend embedded"}
        else:
            v.hints = {"convert": "convert with --target embedded (the embedded engine runs every cell)",
                       "build": "build it with --backend embedded (the embedded engine runs every cell)"}
        v.hint = v.hints["convert"]
    return v


def check_checkpoint_config(cfg: dict, quant_cfg: dict | None, version: str) -> Verdict:
    """``check`` for a written checkpoint (its config.json and optional quant_cfg.json)."""
    ours = cfg.get("trtmoe") or {}
    adapter = adapter_for_checkpoint(cfg)
    family = adapter.family if adapter is not None else None
    if family not in FAMILIES:
        raise UnsupportedError(f"architecture {cfg.get('architecture')!r} has no support-table row",
                               hint="supported: " + ", ".join(TRTLLM_ARCHITECTURE.values()))
    q = ours.get("quantization") or {}
    gran = q.get("granularity")
    per_expert: bool | str = gran if gran in ("expert", "matrix") else \
        (quant_cfg or {}).get("trtmoe_granularity") == "trtmoe-per-expert"
    layer_formats = None
    if q.get("expert_formats"):
        layer_formats = {int(l): canonical_format(fs[0]) for l, fs in q["expert_formats"].items() if fs}
    elif q.get("matrix_formats"):
        per_expert = per_expert or "matrix"
    mp = Mapping.from_config(cfg.get("mapping") or {})
    return check(version, family, layer_formats=layer_formats, per_expert=per_expert, tp=mp.tp_size, pp=mp.pp_size,
                 moe_tp=mp.moe_tp_size, moe_ep=mp.moe_ep_size, moe_layers=ours.get("moe_layers") or (),
                 shared_expert_size=(cfg.get("moe") or {}).get("shared_expert_intermediate_size"))


# ---- the README table -----------------------------------------------------------------------------
_MARK = {SUPPORTED: "yes", UNLISTED: "unlisted", REFUSED: "no"}


def markdown_table(version: str) -> str:
    """The README's support table for one release line (generated; a test compares the README)."""
    rs = release_support(version)
    # The engine path's formats: the fused-MoE ones are refused by every row (see _FUSED_MOE_ONLY).
    fmts = [f for f in FORMATS if f == "float" or QUANT_FORMATS[f].engine_path]
    cols = [f"{FORMAT_LABEL[f]}" for f in fmts] + ["MIXED_PRECISION"] + list(FEATURES)
    lines = [f"| TensorRT-LLM {rs.line} | " + " | ".join(cols) + " |",
             "|" + "---|" * (len(cols) + 1)]
    for fam in FAMILIES:
        row = [_MARK[rs.quant[(fam, f, "uniform")].status] for f in fmts]
        mixed_ok = [f for f in fmts if rs.quant[(fam, f, "mixed")].ok]
        row.append(("yes: " + ", ".join(FORMAT_LABEL[f] for f in mixed_ok)) if mixed_ok else "no")
        row += [_MARK[rs.mapping[(fam, feat)].status] for feat in FEATURES]
        lines.append(f"| {ARCH_LABEL[fam]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def reasons(version: str) -> list[str]:
    """One line per refused or unlisted cell, for the README under the table."""
    rs = release_support(version)
    seen: dict[str, list[str]] = {}
    engine = [f for f in FORMATS if f == "float" or QUANT_FORMATS[f].engine_path]  # the table's columns
    for (fam, fmt, layout), c in rs.quant.items():
        if c.status != SUPPORTED and fmt in engine:
            whole = layout == "mixed" and len({rs.quant[(fam, f, "mixed")] for f in engine}) == 1
            what = (f"{ARCH_LABEL[fam]} MIXED_PRECISION" if whole else
                    f"{ARCH_LABEL[fam]} {FORMAT_LABEL[fmt]}" + (" layers in MIXED_PRECISION" if layout == "mixed"
                                                               else ""))
            whats = seen.setdefault(f"{_MARK[c.status]}: {c.reason}", [])
            if what not in whats:
                whats.append(what)
    for (fam, feat), c in rs.mapping.items():
        if c.status != SUPPORTED:
            seen.setdefault(f"{_MARK[c.status]}: {c.reason}", []).append(f"{ARCH_LABEL[fam]} {feat}")
    return [f"- {', '.join(whats)} — {why}" for why, whats in seen.items()]


def readme_section(version: str) -> str:
    """The README's support section (table plus the reason of each cell that is not a plain yes)."""
    return (markdown_table(version) + "\n\n"
            + "Cells other than *yes*, and why (restated from TensorRT-LLM's source and NVIDIA's support "
              "lists):\n\n" + "\n".join(reasons(version)) + "\n")


if __name__ == "__main__":  # python -m trtmoe.checkpoint.support [RELEASE]: print the README section
    import sys

    print(readme_section(sys.argv[1] if len(sys.argv) > 1 else "1.2"), end="")
