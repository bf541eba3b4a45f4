"""Which engines serve which unified-HF (ModelOpt) checkpoints: one versioned support table.

A cell is (engine release x architecture x format x uniform/mixed x GPU generation). Each cell is
``supported`` (the engine's loader maps the checkpoint's ``quant_algo`` to a fused-MoE method that runs
on that GPU), ``unlisted`` (a path exists but the engine's own lists do not name this combination, or
it runs with other numerics than the checkpoint's, e.g. NVFP4 weights through a W4A16 Marlin kernel;
accepted with a caution) or ``refused`` (the engine would fail to load it or has no kernel on that
GPU). Every cell names the upstream file its fact was restated from.

``convert --target trtllm-pytorch|vllm|sglang`` and ``repo --layout llmapi`` consult :func:`check`; a
refusal names the cell and what would work there. ``docs/deploy-gpu.md`` holds :func:`markdown_table`.
Facts restated (as of 2026-12) from: TensorRT-LLM ``tensorrt_llm/_torch/modules/fused_moe/
MOE_DEVELOPER_GUIDE.md`` (capability matrix), ``fused_moe/quantization.py``, ``fused_moe/
fused_moe_marlin.py``, ``_torch/model_config.py`` (``load_hf_quant_config``), ``_torch/models/
modeling_{mixtral,qwen2_moe,qwen3_moe,deepseekv3,gpt_oss,glm}.py`` (no OLMoE or DeepSeek-V2 class there) and PRs #15485
(per-layer MoE formats for Qwen3-MoE/GLM, open) and #18393 (DeepSeek-V3 W4A8 MIXED_PRECISION); vLLM
``vllm/model_executor/layers/quantization/modelopt.py`` (``modelopt``, ``modelopt_fp4``, ``modelopt_mixed``
from PR #35047), ``quantization/mxfp4.py`` and ``models/{olmoe,deepseek_v2,gpt_oss,glm4_moe}.py``; SGLang
``python/sglang/srt/layers/quantization/modelopt_quant.py`` (``modelopt_mixed``, PR #37752, which routes
W4A16_NVFP4 experts to Marlin) and ``srt/models/gpt_oss.py``; Llama-4 from TensorRT-LLM ``_torch/models/
modeling_llama.py`` (``Llama4MoE``: ``FUSED_GATE_UP_PROJ``, router weight applied on the input), vLLM
``models/llama4.py`` / ``models/mllama4.py`` and ModelOpt 0.47's ``torch/export/unified_export_hf.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnsupportedError

SUPPORTED, UNLISTED, REFUSED = "supported", "unlisted", "refused"

ENGINES = {  # key -> (label, target it belongs to)
    "trtllm-1.2.1": ("TensorRT-LLM 1.2.1 (PyTorch backend)", "trtllm-pytorch"),
    "trtllm-1.4": ("TensorRT-LLM 1.4 (PyTorch backend)", "trtllm-pytorch"),
    "vllm-0.33": ("vLLM 0.33", "vllm"),
    "sglang-0.5": ("SGLang 0.5", "sglang"),
}
DEFAULT_ENGINE = {"trtllm-pytorch": "trtllm-1.2.1", "vllm": "vllm-0.33", "sglang": "sglang-0.5"}
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v1", "phimoe", "deepseek_v2", "deepseek_v3", "gpt_oss",
            "olmoe", "glm4_moe", "llama4", "llama4_text")
ARCH_LABEL = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE",
              "deepseek_v1": "DeepSeek-MoE v1", "phimoe": "Phi-3.5-MoE", "deepseek_v2": "DeepSeek-V2",
              "deepseek_v3": "DeepSeek-V3", "gpt_oss": "gpt-oss", "olmoe": "OLMoE", "glm4_moe": "GLM-4.5",
              "llama4": "Llama-4", "llama4_text": "Llama-4 (text only)"}
# A transformers MoE outside the rows above, read by its Hugging Face names (checkpoint/unified_hf.py
# ``classify_generic``): no engine's model class for it was restated, so no cell of it is more than unlisted.
GENERIC = "transformers"
ARCH_LABEL[GENERIC] = "other transformers MoE"
FORMATS = ("bf16", "fp8", "fp8_block_wo", "nvfp4", "nvfp4_w4a16", "mxfp4", "int8", "w4a8_awq")
FORMAT_LABEL = {"bf16": "BF16", "fp8": "FP8", "fp8_block_wo": "FP8-block WO", "nvfp4": "NVFP4",
                "nvfp4_w4a16": "NVFP4 W4A16", "mxfp4": "MXFP4", "int8": "W8A16", "w4a8_awq": "W4A8-AWQ"}
LAYOUTS = ("uniform", "mixed")
SMS = (89, 90, 100)

_TRT_GUIDE = "tensorrt_llm/_torch/modules/fused_moe/MOE_DEVELOPER_GUIDE.md"
_TRT_QUANT = "tensorrt_llm/_torch/modules/fused_moe/quantization.py"
_TRT_MARLIN = "tensorrt_llm/_torch/modules/fused_moe/fused_moe_marlin.py"
_TRT_CONFIG = "tensorrt_llm/_torch/model_config.py"
_TRT_MODELS = "tensorrt_llm/_torch/models/"
_VLLM = "vllm/model_executor/layers/quantization/modelopt.py"
_SGL = "python/sglang/srt/layers/quantization/modelopt_quant.py"
_TRT_GPT_OSS = "tensorrt_llm/_torch/models/modeling_gpt_oss.py"
_TRT_DSV3 = "tensorrt_llm/_torch/models/modeling_deepseekv3.py"
_VLLM_GPT_OSS = "vllm/model_executor/models/gpt_oss.py"
_VLLM_MXFP4 = "vllm/model_executor/layers/quantization/mxfp4.py"
_SGL_GPT_OSS = "python/sglang/srt/models/gpt_oss.py"
_TRT_LLAMA = "tensorrt_llm/_torch/models/modeling_llama.py"
_VLLM_LLAMA4 = "vllm/model_executor/models/llama4.py"
_VLLM_MLLAMA4 = "vllm/model_executor/models/mllama4.py"
_SGL_LLAMA4 = "python/sglang/srt/models/llama4.py"
# The formats trtmoe writes Llama-4's stacked experts in (checkpoint/unified_hf.py LLAMA4_EXPERT_FORMATS).
_LLAMA4_WRITTEN = ("bf16", "fp8", "nvfp4", "nvfp4_w4a16")
_MODEL_FILES = {  # where each engine's model class for an architecture lives (None: it has none)
    "vllm": {"olmoe": "vllm/model_executor/models/olmoe.py", "deepseek_v3": "vllm/model_executor/models/deepseek_v2.py",
             "deepseek_v2": "vllm/model_executor/models/deepseek_v2.py",
             "glm4_moe": "vllm/model_executor/models/glm4_moe.py"},
    "sglang": {"olmoe": "python/sglang/srt/models/olmoe.py", "deepseek_v3": "python/sglang/srt/models/deepseek_v2.py",
               "deepseek_v2": "python/sglang/srt/models/deepseek_v2.py",
               "glm4_moe": "python/sglang/srt/models/glm4_moe.py"},
    # TensorRT-LLM's PyTorch backend (registered with register_auto_model); None: no class.
    "trtllm-pytorch": {"glm4_moe": "tensorrt_llm/_torch/models/modeling_glm.py", "deepseek_v1": None, "phimoe": None,
                       "olmoe": None, "deepseek_v2": None},
}


@dataclass(frozen=True)
class Cell:
    status: str
    reason: str = ""
    source: str = ""

    @property
    def ok(self) -> bool:
        return self.status != REFUSED


def _trtllm_kernel(fmt: str, sm: int) -> Cell:
    """TensorRT-LLM's fused-MoE capability matrix (the same rows in 1.2.1 and 1.4)."""
    if fmt in ("bf16", "int8"):
        return Cell(SUPPORTED, "", _TRT_GUIDE)  # BF16 and W8A16 INT8 MoE rows run on SM80+
    if fmt == "fp8":
        return Cell(SUPPORTED, "", _TRT_GUIDE)  # FP8 per-tensor QDQ: SM89+
    if fmt == "fp8_block_wo":
        if sm < 90:
            return Cell(REFUSED, "FP8 block-scale MoE kernels exist for SM90 and SM100 only", _TRT_GUIDE)
        return Cell(UNLISTED, "the fused MoE runs FP8 block scales as W8A8 (activations quantized per 1x128 at "
                              "run time); ModelOpt's weight-only quant_algo fp8_pb_wo is not a name the loader is "
                              "documented to map", _TRT_CONFIG)
    if fmt == "nvfp4":
        if sm >= 100:
            return Cell(SUPPORTED, "", _TRT_GUIDE)
        return Cell(UNLISTED, "below SM100 NVFP4 experts run through the Marlin MoE as W4A16 (activations stay "
                              "bf16, the checkpoint's input scales are unused)", _TRT_MARLIN)
    if fmt == "nvfp4_w4a16":
        if sm < 100:
            return Cell(SUPPORTED, "", _TRT_MARLIN)  # W4A16_NVFP4 experts run through the Marlin MoE on SM89-99
        return Cell(UNLISTED, "the capability matrix lists W4A16 NVFP4 as the Marlin MoE path for SM89-99; on SM100 "
                              "the loader's W4A16_NVFP4 route is not listed", _TRT_GUIDE)
    if fmt == "mxfp4":
        if sm < 90:
            return Cell(REFUSED, "W4A16 MXFP4 MoE kernels exist for SM90 (Cutlass/Triton) and SM100", _TRT_GUIDE)
        return Cell(SUPPORTED, "", _TRT_GUIDE)
    if fmt == "w4a8_awq":
        if sm in (89, 90):
            return Cell(SUPPORTED, "", _TRT_QUANT)  # WInt4AFP8FusedMoEMethod: SM89 and SM90
        return Cell(REFUSED, f"the W4A8 AWQ fused MoE (WInt4AFP8FusedMoEMethod) runs on SM89 and SM90 only "
                             f"(unsupported on SM{sm})", _TRT_QUANT)
    raise KeyError(fmt)


def _trtllm_mixed(engine: str, family: str, fmt: str) -> Cell:
    if family == "deepseek_v3":
        if engine != "trtllm-1.2.1" and fmt in ("bf16", "fp8", "w4a8_awq"):
            return Cell(UNLISTED, "DeepSeek-V3's per-layer W4A8 AWQ / FP8 MoE (MIXED_PRECISION) is wired by PR #18393, "
                                  "after 1.2.1; other mixes are not", _TRT_DSV3)
        return Cell(REFUSED, "DeepSeek-V3 reads MIXED_PRECISION only as per-layer W4A8 AWQ / FP8 (PR #18393, after "
                             "1.2.1)", _TRT_DSV3)
    why = ("per-layer MoE formats (MIXED_PRECISION) are wired model by model: DeepSeek-V3's W4A8 in PR #18393; "
           "for Qwen3-MoE and GLM PR #15485 is open (the loader calls MIXED_PRECISION ambiguous for a fused MoE); "
           f"{ARCH_LABEL[family]}'s model class does not pass a per-layer quant config to its MoE")
    return Cell(REFUSED, why, _MODEL_FILES["trtllm-pytorch"].get(family) or _TRT_MODELS + f"modeling_{family}.py")


def _serving_kernel(engine: str, fmt: str, sm: int) -> Cell:
    """vLLM / SGLang: modelopt (FP8), modelopt_fp4 (NVFP4), modelopt_mixed (per layer)."""
    src = _VLLM if engine.startswith("vllm") else _SGL
    if fmt == "bf16":
        return Cell(SUPPORTED, "", src)
    if fmt == "fp8":
        return Cell(SUPPORTED, "", src)
    if fmt == "nvfp4":
        if sm >= 100:
            return Cell(SUPPORTED, "", src)
        return Cell(UNLISTED, "below SM100 NVFP4 MoE weights run through Marlin as W4A16 (input scales unused)", src)
    if fmt == "nvfp4_w4a16" and engine.startswith("sglang"):
        return Cell(SUPPORTED, "", src)  # modelopt_mixed routes W4A16_NVFP4 experts to the Marlin MoE (PR #37752)
    return Cell(UNLISTED, f"the ModelOpt loader is documented for FP8 / NVFP4 (and their MIXED_PRECISION); "
                          f"quant_algo {FORMAT_LABEL[fmt]} through it is not verified", src)


def _gpt_oss(engine: str, fmt: str, layout: str, sm: int) -> Cell:
    """gpt-oss's experts are read in the layout its own release uses: BF16 ``gate_up_proj`` / ``down_proj``
    (transposed, gate/up interleaved, with biases) or MXFP4 ``*_blocks`` / ``*_scales`` (HF
    ``quant_method: mxfp4``); the model classes read no ModelOpt expert tensors."""
    trt = engine.startswith("trtllm")
    src = _TRT_GPT_OSS if trt else (_VLLM_GPT_OSS if engine.startswith("vllm") else _SGL_GPT_OSS)
    if layout == "mixed":
        return Cell(REFUSED, "gpt-oss's loader takes one expert format for the whole model (BF16 or MXFP4)", src)
    if fmt == "bf16":
        return Cell(SUPPORTED, "", src)
    if fmt != "mxfp4":
        return Cell(REFUSED, f"gpt-oss's loader reads its experts as BF16 or as MXFP4 _blocks/_scales only, not "
                             f"as {FORMAT_LABEL[fmt]}", src)
    if trt:
        return _trtllm_kernel(fmt, sm)
    if sm < 90:
        return Cell(UNLISTED, "below SM90 MXFP4 experts run through a Marlin W4A16 fallback", _VLLM_MXFP4)
    return Cell(SUPPORTED, "", _VLLM_MXFP4 if engine.startswith("vllm") else _SGL_GPT_OSS)


def _llama4(engine: str, family: str, fmt: str, layout: str, sm: int) -> Cell:
    """Llama-4 with its experts stacked per projection as ModelOpt exports them (``feed_forward.experts.
    gate_up_proj`` ``[E, in, out]`` and ``gate_up_proj_weight_scale`` ... beside it): the released multimodal
    checkpoints (``Llama4ForConditionalGeneration``, family ``llama4``) and the text model alone
    (``Llama4ForCausalLM`` with a ``llama4_text`` config, family ``llama4_text``)."""
    if fmt not in _LLAMA4_WRITTEN:
        return Cell(REFUSED, "trtmoe writes Llama-4's stacked experts in BF16, FP8, NVFP4 and NVFP4 W4A16 only (ModelOpt "
                             "0.47's INT8 export of the stack fails; its MXFP4 and FP8-block forms scale along other "
                             "axes than the ones quantized)", "modelopt/torch/export/unified_export_hf.py")
    if engine.startswith("sglang"):
        return Cell(UNLISTED, "SGLang's Llama-4 loader was not restated for ModelOpt's stacked expert tensors",
                    _SGL_LLAMA4)
    if engine.startswith("trtllm"):
        if family == "llama4_text":
            return Cell(REFUSED, "TensorRT-LLM's Llama4ForCausalLM and Llama4ForConditionalGeneration build from "
                                 "config.text_config (the released multimodal Llama4Config); a text-only llama4_text "
                                 "config has none", _TRT_LLAMA)
        if layout == "mixed":
            return Cell(REFUSED, "per-layer MoE formats (MIXED_PRECISION) are wired model by model; Llama4MoE passes "
                                 "no per-layer quant config to its fused MoE", _TRT_LLAMA)
        if fmt == "nvfp4_w4a16":
            return Cell(UNLISTED, "Llama4MoE reads the stacked experts in FUSED_GATE_UP_PROJ mode; the Marlin MoE's "
                                  "reading of that mode was not restated", f"{_TRT_LLAMA}, {_TRT_MARLIN}")
        # fused_moe/quantization.py reads gate_up_proj[e] (and NVFP4's block scales) transposed and split in
        # half, gate first, with one gate_up_proj_weight_scale(_2) / _input_scale for every expert.
        c = _trtllm_kernel(fmt, sm)
        return Cell(c.status, c.reason, f"{_TRT_LLAMA}, {_TRT_QUANT}")
    if fmt == "bf16":
        return Cell(SUPPORTED, "", _VLLM_LLAMA4)  # fused experts: gate_up split on its last dim, transposed
    if family == "llama4_text":
        return Cell(UNLISTED, "vLLM renames ModelOpt's stacked Llama-4 expert scales (gate_up_proj_weight_scale, "
                              "_input_scale -> w13_*) in mllama4.py, for Llama4ForConditionalGeneration; the text-only "
                              "loader in llama4.py splits every experts.gate_up_proj* tensor along its last dim, which "
                              "a per-tensor scale has none of", f"{_VLLM_LLAMA4}, {_VLLM_MLLAMA4}")
    if fmt == "fp8" and layout == "uniform":
        # mllama4.py maps the per-tensor scales to w13_/w2_ scales loaded for every expert; llama4.py splits
        # and transposes the stacked FP8 weights like BF16 ones.
        return Cell(SUPPORTED, "", f"{_VLLM_MLLAMA4}, {_VLLM_LLAMA4}, {_VLLM}")
    return Cell(UNLISTED, "vLLM's Llama-4 loader was restated for BF16 and per-tensor FP8 stacks; NVFP4 block scales "
                          "of a stack and per-layer formats through it were not", f"{_VLLM_MLLAMA4}, {_VLLM_LLAMA4}")


def _generic(engine: str, fmt: str, layout: str, sm: int) -> Cell:
    """A MoE without a row: what the engine's kernels and ModelOpt loader do with the format, at best unlisted,
    since whether the engine has a model class reading this architecture's tensors was not restated."""
    trt = engine.startswith("trtllm")
    if trt and layout == "mixed":
        return Cell(REFUSED, "per-layer MoE formats (MIXED_PRECISION) are wired model by model in TensorRT-LLM's "
                             "PyTorch backend (DeepSeek-V3's W4A8 in PR #18393)", _TRT_MODELS)
    c = _trtllm_kernel(fmt, sm) if trt else _serving_kernel(engine, fmt, sm)
    if c.status == REFUSED:
        return c
    why = (f"the support table has no row for this architecture: the checkpoint keeps its Hugging Face names in "
           f"ModelOpt's layout, but whether {ENGINES[engine][0]} has a model class that loads them was not checked")
    return Cell(UNLISTED, why + (f"; {c.reason}" if c.reason else ""), c.source)


def cell(engine: str, family: str, fmt: str, layout: str, sm: int) -> Cell:
    """One cell of the table (KeyError for an unknown engine, family, format, layout or GPU)."""
    if family == GENERIC and engine in ENGINES and fmt in FORMATS and layout in LAYOUTS and sm in SMS:
        return _generic(engine, fmt, layout, sm)
    if engine not in ENGINES or family not in FAMILIES or fmt not in FORMATS or layout not in LAYOUTS or sm not in SMS:
        raise KeyError((engine, family, fmt, layout, sm))
    if family == "gpt_oss":
        return _gpt_oss(engine, fmt, layout, sm)
    if family in ("llama4", "llama4_text"):
        return _llama4(engine, family, fmt, layout, sm)
    if engine.startswith("trtllm"):
        if family == "deepseek_v2":  # modeling_deepseekv3.py registers DeepseekV3ForCausalLM / V32 only
            return Cell(REFUSED, "the PyTorch backend registers no DeepseekV2ForCausalLM (its DeepSeek class is "
                                 "registered for DeepseekV3ForCausalLM and DeepseekV32ForCausalLM)", _TRT_DSV3)
        if family in ("deepseek_v1", "phimoe", "olmoe"):
            return Cell(REFUSED, f"the PyTorch backend has no {ARCH_LABEL[family]} model class", _TRT_MODELS)
        if layout == "mixed":
            return _trtllm_mixed(engine, family, fmt)
        c = _trtllm_kernel(fmt, sm)
        model_file = _MODEL_FILES["trtllm-pytorch"].get(family)
        return Cell(c.status, c.reason, f"{model_file}, {c.source}") if model_file else c
    if family in ("deepseek_v1", "phimoe"):
        return Cell(UNLISTED, f"{ARCH_LABEL[family]} has a model class but no ModelOpt-quantized checkpoint is "
                              "listed for it", _VLLM if engine.startswith("vllm") else _SGL)
    c = _serving_kernel(engine, fmt, sm)
    model_file = _MODEL_FILES[ENGINES[engine][1]].get(family)
    if model_file:  # the architecture's model class maps the experts' ModelOpt tensors through FusedMoE
        c = Cell(c.status, c.reason, f"{model_file}, {c.source}")
    if layout == "mixed" and c.status == SUPPORTED and fmt not in ("bf16", "fp8", "nvfp4", "nvfp4_w4a16"):
        return Cell(UNLISTED, "modelopt_mixed maps FP8 and NVFP4 layers", c.source)
    return c


# ---- checking a plan -----------------------------------------------------------------------------

@dataclass
class Verdict:
    cells: list[dict] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    cautions: list[str] = field(default_factory=list)
    works: str = ""

    @property
    def ok(self) -> bool:
        return not self.refusals

    def raise_if_refused(self, where: str | None = None) -> None:
        if self.refusals:
            raise UnsupportedError(self.refusals[0], where=where, hint="what works there: " + self.works)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "cells": self.cells, "refusals": self.refusals, "cautions": self.cautions,
                "what_works": self.works}


def what_works(engine: str, family: str, sm: int) -> str:
    uni = [FORMAT_LABEL[f] for f in FORMATS if cell(engine, family, f, "uniform", sm).ok]
    mixed = [FORMAT_LABEL[f] for f in FORMATS if cell(engine, family, f, "mixed", sm).ok]
    s = ("uniform " + ", ".join(uni)) if uni else "nothing"
    s += ("; MIXED_PRECISION of " + ", ".join(mixed)) if mixed else "; no MIXED_PRECISION"
    alt = [e for e in ENGINES if e != engine and any(cell(e, family, f, "mixed", sm).status == SUPPORTED
                                                     for f in FORMATS)]
    takes = [e for e in ENGINES if e != engine and any(cell(e, family, f, "uniform", sm).ok for f in FORMATS)]
    if not uni and takes:
        s = f"nothing (the architecture loads on {', '.join(ENGINES[e][0] for e in takes)})"
    elif not mixed and alt:
        s += f" (per-layer plans: {', '.join(ENGINES[e][0] for e in alt)})"
    return s


def check(engine: str, family: str, formats: set[str], sm: int) -> Verdict:
    """The cells a checkpoint whose quantized linears use ``formats`` touches on ``engine`` / SM ``sm``."""
    if engine not in ENGINES:
        raise UnsupportedError(f"unknown engine release {engine!r}", hint="one of " + ", ".join(ENGINES))
    if sm not in SMS:
        raise UnsupportedError(f"GPU generation SM{sm} has no column", hint="one of " + ", ".join(f"SM{s}" for s in SMS))
    if family not in FAMILIES and family != GENERIC:
        raise UnsupportedError(f"architecture {family!r} has no unified-HF support row",
                               hint="rows: " + ", ".join(ARCH_LABEL.values()))
    fmts = sorted({f for f in formats}, key=FORMATS.index) or ["bf16"]
    quantized = [f for f in fmts if f != "bf16"]
    layout = "mixed" if len(quantized) > 1 else "uniform"
    v = Verdict(works=what_works(engine, family, sm))
    label = ENGINES[engine][0]
    for f in (quantized or ["bf16"]):
        c = cell(engine, family, f, layout, sm)
        key = f"{label} x {ARCH_LABEL[family]} x {FORMAT_LABEL[f]} x {layout} x SM{sm}"
        v.cells.append({"cell": key, "status": c.status, "reason": c.reason, "source": c.source})
        if c.status == REFUSED:
            v.refusals.append(f"{key}: refused: {c.reason} ({c.source})")
        elif c.status == UNLISTED:
            v.cautions.append(f"{key}: unlisted: {c.reason} ({c.source})")
    return v


# ---- the docs table -------------------------------------------------------------------------------
_MARK = {SUPPORTED: "yes", UNLISTED: "unlisted", REFUSED: "no"}


def markdown_table() -> str:
    """One row per engine x architecture x layout; one column per format x GPU generation."""
    cols = [f"{FORMAT_LABEL[f]} SM{sm}" for f in FORMATS if f != "bf16" for sm in SMS]
    lines = ["| engine | architecture | layout | BF16 | " + " | ".join(cols) + " |",
             "|" + "---|" * (len(cols) + 4)]
    for e in ENGINES:
        for fam in FAMILIES:
            for layout in LAYOUTS:
                row = [_MARK[cell(e, fam, f, layout, sm).status] for f in FORMATS if f != "bf16" for sm in SMS]
                bf = _MARK[cell(e, fam, "bf16", layout, 90).status]
                lines.append(f"| {ENGINES[e][0]} | {ARCH_LABEL[fam]} | {layout} | {bf} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def reasons() -> list[str]:
    seen: dict[tuple[str, str, str], list[str]] = {}
    for e in ENGINES:
        for fam in FAMILIES:
            for f in FORMATS:
                for layout in LAYOUTS:
                    for sm in SMS:
                        c = cell(e, fam, f, layout, sm)
                        if c.status != SUPPORTED:
                            what = f"{ENGINES[e][0]} {ARCH_LABEL[fam]} {FORMAT_LABEL[f]} {layout} SM{sm}"
                            seen.setdefault((_MARK[c.status], c.reason, c.source), []).append(what)
    out = []
    for (mark, why, src), whats in seen.items():
        shown = ", ".join(whats[:3]) + (f" and {len(whats) - 3} more" if len(whats) > 3 else "")
        out.append(f"- **{mark}** ({len(whats)} cells: {shown}) — {why} (`{src}`)")
    return out


def docs_section() -> str:
    return markdown_table() + "\n\nCells other than *yes*, and why:\n\n" + "\n".join(reasons()) + "\n"


if __name__ == "__main__":  # python -m trtmoe.checkpoint.unified_support: print the docs section
    print(docs_section(), end="")
