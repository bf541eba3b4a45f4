"""``trtmoe inspect`` for a MoE outside trtmoe's architecture registry: counted from transformers' own model.

The registry's architectures are described by their rule tables (``report.inspect``). Any other MoE that
transformers implements (DeepSeek-V2/V3, gpt-oss, OLMoE, GLM-4.5, Llama-4, ...) is built from its
``config.json`` on the meta device (no weights read, no memory spent), its routed experts found at the
experts seam the layer-streamed calibration uses, and every parameter counted by the module that holds it.
Per-rank bytes need the registry's layout rules, so a parallel layout is not planned here: the unified-HF
engines that serve these models (TensorRT-LLM's PyTorch backend, vLLM, SGLang) shard them themselves.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InputError, UnsupportedError
from ..hf.reader import read_json
from ..hf.adapters import supported_architectures
from ..hf.validate import validate_hf_config
from ..hf.experts_seam import expert_input_weight
from ..quant.stream import (NO_SEAM, ExpertLayout, adapt_seams, experts_per_token, find_experts, layers_elsewhere,
                             no_causal_lm)

# The deepest model counted from transformers' own modules (building one on the meta device takes about
# 0.1 s per layer); released MoEs have at most a few hundred layers.
MAX_LAYERS = 512
# Components in the order the registry's report lists them.
ORDER = ("embedding", "lm_head", "lm_head (tied)", "attention", "norms", "routers", "shared experts",
         "routed experts", "dense MLPs", "other")


def _meta_model(path: Path):
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is installed wherever tests run
        raise UnsupportedError(f"this architecture is counted through transformers' model, which cannot be "
                               f"imported ({e})", where=str(path)) from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as e:
        raise UnsupportedError(f"neither trtmoe's registry nor transformers knows this architecture ({e})",
                               where=str(path / "config.json")) from None
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError):
        raise UnsupportedError(no_causal_lm(config), where=str(path)) from None
    return config, model


def _source_bytes(path: Path) -> int | None:
    files = sorted(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def describe_transformers_moe(model_dir: str | Path) -> dict:
    """The ``inspect`` report (parameters and activation) of a MoE transformers implements, from its config."""
    path = Path(model_dir)
    raw = read_json(path / "config.json")
    if isinstance(raw, dict) and raw.get("is_encoder_decoder"):  # before the decoder-only field checks
        arch = (raw.get("architectures") or [raw.get("model_type")])[0]
        raise UnsupportedError(f"{arch} is an encoder-decoder model: decoder-only causal MoEs only",
                               where=str(path / "config.json"))
    raw = validate_hf_config(raw, path / "config.json", registry=False)
    layers = (raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw).get("num_hidden_layers")
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise InputError(f"num_hidden_layers = {layers}: this count builds transformers' model from the config, "
                         f"layer by layer (at most {MAX_LAYERS}; no released MoE has more)",
                         where=str(path / "config.json"))
    config, model = _meta_model(path)
    tc = config.get_text_config()
    try:
        adapt_seams(model)
    except InputError as e:
        raise UnsupportedError(e.what, where=str(path)) from None
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UnsupportedError(layers_elsewhere(model, config) if tc is not config
                               else f"{type(model).__name__}: no decoder layers (model.layers) to count", where=str(path))
    hidden = int(tc.hidden_size)
    routed: dict[str, int] = {}  # experts-module prefix -> its number of experts
    routers: set[str] = set()
    moe_layers, ffn, first_router = [], None, None
    for i, lay in enumerate(layers):
        found = find_experts(lay)
        if found is None:
            continue
        mod, router = found
        first_router = router if not moe_layers else first_router
        moe_layers.append(i)
        names = {id(m): n for n, m in lay.named_modules()}
        gu, gated = expert_input_weight(mod)
        routed[f"model.layers.{i}.{names[id(mod)]}."] = int(gu.shape[0])
        if router is not None and id(router) in names:
            routers.add(f"model.layers.{i}.{names[id(router)]}.")
        if gated:
            lay_out = ExpertLayout.of(mod, hidden)
            ffn = int((gu.shape[2] if lay_out.transposed else gu.shape[1]) // 2)
        else:
            ffn = int(gu.shape[1] if gu.shape[2] == hidden else gu.shape[2])
    if not moe_layers:
        raise UnsupportedError(f"{type(model).__name__} has {NO_SEAM}", where=str(path))
    E = next(iter(routed.values()))
    k = experts_per_token(tc, first_router)
    if k < 1:
        raise UnsupportedError("the config names no experts per token (num_experts_per_tok)", where=str(path))
    comp: dict[str, list[int]] = {}

    def add(name: str, total: int, active: int) -> None:
        t = comp.setdefault(name, [0, 0])
        t[0] += total
        t[1] += active

    unpicked = 0
    dense = {f"model.layers.{i}." for i in range(len(layers)) if i not in moe_layers}
    head = getattr(model, "lm_head", None)
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    for name, p in model.named_parameters():  # a tied head is yielded once, as the embedding
        n = p.numel()
        low = name.lower()
        pre = next((r for r in routed if name.startswith(r)), None)
        if pre is not None:
            add("routed experts", n, n * k // routed[pre])
            unpicked += n * (routed[pre] - k) // routed[pre]
        elif "embed" in low and p.dim() == 2:
            add("embedding", n, p.shape[1])
            if tied:
                add("lm_head (tied)", 0, n)
        elif name.startswith("lm_head"):
            add("lm_head", n, n)
        elif any(name.startswith(r) for r in routers):
            add("routers", n, n)
        elif "shared" in low:
            add("shared experts", n, n)
        elif "attn" in low or "attention" in low:
            add("attention", n, n)
        elif "norm" in low:
            add("norms", n, n)
        elif any(name.startswith(d) for d in dense) and ("mlp" in low or "feed_forward" in low):
            add("dense MLPs", n, n)
        else:
            add("other", n, n)
    total = sum(t for t, _ in comp.values())
    active = sum(a for _, a in comp.values())
    src = _source_bytes(path)
    return {
        "model": str(path), "architecture": (config.architectures or [type(model).__name__])[0],
        # The text model's type names the family, except for a multimodal Llama-4, whose engines' cells differ
        # from its text model's alone (they read the whole checkpoint's config).
        "family": str(config.model_type if getattr(config, "model_type", None) == "llama4"
                      else getattr(tc, "model_type", "unknown")), "weights_present": src is not None,
        "registry": False,
        "config": {"num_layers": len(layers), "num_experts": E, "top_k": k, "hidden_size": hidden,
                   "expert_intermediate_size": ffn, "vocab_size": int(tc.vocab_size)},
        "moe_layers": moe_layers, "dense_layers": [i for i in range(len(layers)) if i not in moe_layers],
        "parameters": {"total": total, "active_per_token": active, "active_share": active / total,
                       "activated": total - unpicked,
                       "components": {c: {"total": comp[c][0], "active_per_token": comp[c][1]}
                                      for c in ORDER if c in comp}},
        "source_bytes": src,
    }


def layout_problem(rep: dict, tp: int, pp: int, moe_tp: int | None, moe_ep: int | None) -> str | None:
    """Why a parallel layout is not planned for an architecture outside the registry (None: one rank)."""
    if (tp, pp, moe_tp or 1, moe_ep or 1) == (1, 1, 1, 1):
        return None
    return (f"per-rank bytes are planned for the registry's architectures only, not for {rep['architecture']}; "
            "outside the registry a model is exported as a unified-HF checkpoint (--target trtllm-pytorch, vllm or "
            "sglang), which those engines shard themselves")


def outside_registry(path: Path) -> bool:
    """Whether ``path``'s config.json names an architecture that trtmoe's registry does not describe."""
    cfg = read_json(path / "config.json") if (path / "config.json").is_file() else None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    return isinstance(archs, list) and bool(archs) and all(isinstance(a, str) for a in archs) and \
        not any(a in supported_architectures() for a in archs)
