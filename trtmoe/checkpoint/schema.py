"""The TensorRT-LLM checkpoint schema, one versioned table.

TensorRT-LLM parses ``mapping``, ``moe`` and ``quantization`` strictly (``cls(**d)``): an unknown key
is a TypeError at build time. These tables say which keys each supported release line accepts; the
writer emits only keys from the table and ``verify`` rejects anything else. Which (architecture ×
quantization × layout × mapping) cells a release line can build is the support table beside it,
``trtmoe.checkpoint.support``, keyed by the same release lines.
"""

from __future__ import annotations

from ..errors import UnsupportedError
from ..hf.adapters import ADAPTERS

_MAPPING_1X = frozenset({
    "world_size", "rank", "gpus_per_node", "cp_size", "tp_size", "pp_size", "moe_tp_size", "moe_ep_size",
    "moe_cluster_size", "attn_tp_size", "attn_cp_size", "cp_config", "enable_attention_dp",
    "enable_lm_head_tp_in_adp", "pp_partition",
})
_MOE_1X = frozenset({
    "num_experts", "top_k", "normalization_mode", "sparse_mixer_epsilon", "tp_mode",
    "shared_expert_intermediate_size", "device_limited_n_group", "device_limited_topk_group",
    "device_limited_routed_scaling_factor",
})
_QUANT_1X = frozenset({
    "quant_algo", "kv_cache_quant_algo", "group_size", "smoothquant_val", "clamp_val", "use_meta_recipe",
    "has_zero_point", "pre_quant_scale", "exclude_modules",
})
_QUANT_ALGOS_1X = frozenset({
    None, "W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W8A16_GPTQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL", "FP8",
    "MIXED_PRECISION", "NVFP4", "NO_QUANT",
})

# Top-level keys each model class of the release line reads as a plain attribute, with no default in its
# config class or in PretrainedConfig.__init__ (which sets only its named parameters and the extra keys
# it is given): a checkpoint without one fails when trtllm-build constructs the model (AttributeError).
# Each architecture's registry entry states its own (``Adapter.trtllm_required_keys``, with the reason).
_REQUIRED_1X = {a.trtllm_architecture: a.trtllm_required_keys for a in ADAPTERS.values() if a.trtllm_required_keys}

SCHEMAS: dict[str, dict] = {
    # 1.2.x: the last release line with the trtllm-build engine path.
    "1.2": {"mapping": _MAPPING_1X, "moe": _MOE_1X, "quantization": _QUANT_1X, "quant_algos": _QUANT_ALGOS_1X,
            "required": _REQUIRED_1X,
            "qwen_shared_expert_prefix": "mlp.shared_expert", "tested_releases": ("1.2.0", "1.2.1")},
}
DEFAULT_VERSION = "1.2"

# The minimal key set we write for each strict block (a subset of every supported table).
MAPPING_KEYS = ("world_size", "gpus_per_node", "cp_size", "tp_size", "pp_size", "moe_tp_size", "moe_ep_size")


def schema_for(version: str) -> dict:
    """Accepts a release line ('1.2') or a full release ('1.2.1')."""
    line = ".".join(str(version).split(".")[:2])
    if line not in SCHEMAS:
        raise UnsupportedError(f"TensorRT-LLM version {version!r} is not supported",
                               hint="supported release lines: " + ", ".join(sorted(SCHEMAS)))
    return SCHEMAS[line]


def check_strict_blocks(config: dict, version: str) -> list[str]:
    """Problems with the strict blocks of a checkpoint config.json (empty list = fine)."""
    s = schema_for(version)
    problems = []
    for block in ("mapping", "moe", "quantization"):
        d = config.get(block)
        if d is None:
            if block != "moe":
                problems.append(f"missing {block!r} block")
            continue
        extra = sorted(set(d) - s[block])
        if extra:
            problems.append(f"{block!r} has keys TensorRT-LLM {version} rejects: {extra}")
    arch = config.get("architecture")
    missing = [k for k in s["required"].get(arch, ()) if config.get(k) is None]
    if missing:
        problems.append(f"lacks {missing}, which TensorRT-LLM {version}'s {arch} reads with no default")
    algo = (config.get("quantization") or {}).get("quant_algo")
    if algo not in s["quant_algos"]:
        problems.append(f"quant_algo {algo!r} is not known to TensorRT-LLM {version}")
    return problems


# Which quantization algorithms give a MoE layer's stacked ``fc`` / ``proj`` a ``prequant_scaling_factor``
# in TensorRT-LLM's fused MoE (its MoE weight wrapper declares one [1, in_features] tensor, in the model
# dtype, per stacked fc and per stacked proj — shared by the layer's experts — only for group-wise
# weight quantization with a pre-quant scale; per-channel weight-only and unquantized layers have none).
MOE_PREQUANT_ALGOS: dict[str, frozenset] = {"1.2": frozenset({"W4A16_AWQ", "W4A8_AWQ"})}


def moe_prequant_problems(tensors: dict[str, tuple[int, ...]], layer_algos: dict[int, str | None],
                          in_features: dict[str, int], version: str = DEFAULT_VERSION) -> list[str]:
    """Problems with the pre-quant scales of one rank's routed-expert tensors (empty list = fine):
    ``tensors`` maps names to shapes, ``layer_algos`` gives each local MoE layer's quant_algo and
    ``in_features`` the per-rank input size of ``fc`` and ``proj``. A layer whose algorithm declares the
    scale needs exactly ``transformer.layers.{j}.mlp.{fc,proj}.prequant_scaling_factor`` [1, in]; no other
    MoE tensor may carry one."""
    declared = MOE_PREQUANT_ALGOS[".".join(str(version).split(".")[:2])]
    problems, want = [], {}
    for j, algo in layer_algos.items():
        if algo in declared:
            for mod in ("fc", "proj"):
                want[f"transformer.layers.{j}.mlp.{mod}.prequant_scaling_factor"] = (1, in_features[mod])
    for name, shape in want.items():
        if name not in tensors:
            problems.append(f"{name} is missing (TensorRT-LLM declares it for this layer's quant_algo)")
        elif tuple(tensors[name]) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name])}, TensorRT-LLM declares {shape}")
    for name in tensors:
        if name.endswith("prequant_scaling_factor") and ".mlp." in name and name not in want:
            problems.append(f"{name}: TensorRT-LLM declares no pre-quant scale there")
    return problems
