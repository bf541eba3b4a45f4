"""The targets of the TensorRT-LLM checkpoint (``trtmoe convert`` without a unified-HF target): the
embedded PyTorch engine, which runs every plan trtmoe writes, and TensorRT-LLM 1.2's engine builder
(``trtllm-build``), which runs what its support table (``trtmoe.checkpoint.support``) lists."""

from __future__ import annotations

from ..checkpoint import support
from ..checkpoint.writer import convert
from ..errors import NotBuildable, UnsupportedError
from .base import Target


class EngineCheckpoint(Target):
    """A target whose checkpoint is TensorRT-LLM's layout (rank files, config.json), written by
    ``trtmoe.checkpoint.writer.convert``, and built into an engine directory."""

    artifact = "trtllm-checkpoint"
    calibrates = True

    # ``check(config, quant_cfg, version)`` -> verdict on a checkpoint's config.json before it is
    # written, refusing what the target cannot build; None: the target runs every checkpoint.
    checkpoint_check = None

    def write(self, model, out, **options):
        """``trtmoe.checkpoint.writer.convert`` for this target (its options: layout, dtype, plan)."""
        return convert(model, out, check=self.checkpoint_check, **options)


class Embedded(EngineCheckpoint):
    """The embedded PyTorch engine: any granularity (per matrix, per expert, per layer), every format;
    one process holds every rank."""

    name = "embedded"
    label = "embedded engine"
    build_backend = "embedded"


class TensorRTLLMEngine(EngineCheckpoint):
    """TensorRT-LLM 1.2's engine path: one format per MoE layer (its fused MoE plugin), the formats
    and layouts its support table lists, group-wise int4 with a pre-quant scale shared by the layer."""

    name = "tensorrt-llm"
    label = "TensorRT-LLM"
    stacked_scoring = True
    layer_only = True
    rounder = "engine builder"
    build_backend = "tensorrt-llm"
    per_rank_memory = True
    checkpoint_check = staticmethod(support.check_checkpoint_config)

    def plan_granularity(self, asked: str, policy: str, budgeted: bool) -> str:
        granularity = "layer" if asked == "auto" else asked
        if policy == "none":
            return granularity
        if granularity == "matrix":
            raise UnsupportedError("TensorRT-LLM's fused MoE plugin runs one format per MoE layer, and its "
                                   "MIXED_PRECISION config requires a MoE layer's fc and proj to share it; "
                                   "per-matrix formats (fc and proj apart) only run on the embedded engine",
                                   hint="use --granularity layer (the default for --target tensorrt-llm), "
                                        "or --target embedded")
        if granularity == "expert":
            raise UnsupportedError("TensorRT-LLM's fused MoE plugin runs one format per MoE layer; per-expert "
                                   "formats only run on the embedded engine",
                                   hint="use --granularity layer (the default for --target tensorrt-llm)")
        if policy == "frequency":
            raise UnsupportedError("the frequency-tier policy assigns formats per expert, which TensorRT-LLM "
                                   "cannot run", hint="use --policy frequency-bytes or graded for --target tensorrt-llm")
        return granularity

    def support_options(self, trtllm_version: str, family: str) -> support.Options:
        return support.options(trtllm_version, family)

    def plan_label(self, family: str, options: support.Options) -> str:
        return f"{support.ARCH_LABEL[family]} on TensorRT-LLM {options.line}"

    def support_report(self, *, model=None, family=None, mapping=None, fmt=None, trtllm_version=None, sm=90,
                       engine=None) -> dict | None:
        """The support table's cells of ``model`` (a ModelSpec of the registry) in ``mapping`` with every
        MoE layer's routed experts in ``fmt`` (None: float)."""
        if model is None or mapping is None or model.family not in support.FAMILIES:
            return None
        fmts = {l: fmt or "float" for l, x in enumerate(model.moe_layers) if x}
        v = support.check(trtllm_version, model.family, layer_formats=fmts, tp=mapping.tp_size, pp=mapping.pp_size,
                          moe_tp=mapping.moe_tp_size, moe_ep=mapping.moe_ep_size, moe_layers=list(model.moe_layers),
                          shared_expert_size=model.shared_expert_intermediate_size)
        return {"release": trtllm_version, **v.to_dict(), "what_works": support.what_works(trtllm_version, model.family)}

    def refusal(self, sup: dict) -> NotBuildable:
        return NotBuildable(f"TensorRT-LLM {sup['release']} does not build this layout and format: "
                            + "; ".join(sup["refusals"]), hint=f"it builds {sup['what_works']}")

    def chunks_prompts(self, build: dict) -> bool:
        return bool(build["use_paged_context_fmha"] and build["remove_input_padding"])

    def no_chunking_reason(self) -> str:
        return "; chunked context needs use_paged_context_fmha and remove_input_padding)"

    def check_build(self, build: dict, dtype: str, problems: list[str], notes: list[str]) -> None:
        b = build
        ms, mnt, mbs = b["max_seq_len"], b["max_num_tokens"], b["max_batch_size"]
        if b["use_paged_context_fmha"] and b["kv_cache_type"] != "paged":
            problems.append(f"use_paged_context_fmha needs kv_cache_type paged, got {b['kv_cache_type']}")
        if b["use_paged_context_fmha"] and not b["context_fmha"]:
            problems.append("use_paged_context_fmha needs context_fmha")
        for plugin in ("gemm_plugin", "gpt_attention_plugin", "moe_plugin"):
            v = b[plugin]
            if v not in ("auto", "disable") and v != dtype:
                problems.append(f"{plugin} {v} differs from the checkpoint dtype {dtype} (use auto)")
        if mnt > mbs * ms:
            notes.append(f"max_num_tokens {mnt} > max_batch_size × max_seq_len = {mbs * ms}; trtllm-build "
                         f"clips it to {mbs * ms}")
        if mnt > 16384:
            notes.append(f"max_num_tokens {mnt} > 16384: activation memory grows with it (trtllm-build warns)")
