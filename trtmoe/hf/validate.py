"""Checks on a Hugging Face ``config.json`` before any fact is read from it.

Every field the adapters read is checked for its JSON type and range here, so that a wrong type
is one message naming the key (not a traceback from ``int("abc")``), a fractional size is refused
rather than truncated, and config facts that change the numerics but that no trtmoe target can
honour (a sliding attention window, RoPE settings that contradict each other) are refused by
name instead of being dropped.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, UnsupportedError
from .adapters import ADAPTERS, HF_MODEL_TYPES, supported_architectures

# Integer fields and their smallest allowed value (absent or null means "not given").
_INT_FIELDS = {
    "vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "head_dim": 1, "max_position_embeddings": 1, "intermediate_size": 1,
    "moe_intermediate_size": 1, "num_local_experts": 1, "num_experts": 1, "n_routed_experts": 1,
    "num_experts_per_tok": 1, "shared_expert_intermediate_size": 0, "decoder_sparse_step": 1,
    "first_k_dense_replace": 0, "moe_layer_freq": 1, "n_shared_experts": 0, "sliding_window": 0,
}
_FLOAT_FIELDS = {"rope_theta", "rms_norm_eps"}
_BOOL_FIELDS = {"tie_word_embeddings", "norm_topk_prob", "qkv_bias", "attention_bias", "use_sliding_window"}
_STR_FIELDS = {"hidden_act", "scoring_func", "dtype", "torch_dtype", "model_type"}
_DICT_FIELDS = {"rope_parameters", "rope_scaling"}
# The default the adapters assume when max_position_embeddings is not given.
_DEFAULT_CONTEXT = 4096
# Far beyond any real model: a larger count is a corrupt file, and reading it literally would
# allocate per-layer or per-expert tables until memory runs out.
_COUNT_LIMITS = {"num_hidden_layers": 100_000, "num_attention_heads": 100_000, "num_key_value_heads": 100_000,
                 "num_local_experts": 1_000_000, "num_experts": 1_000_000, "n_routed_experts": 1_000_000,
                 "num_experts_per_tok": 1_000_000, "n_shared_experts": 1_000_000}
_SIZE_LIMIT = 1 << 40
_SUPPORTED = frozenset(supported_architectures())
# The model_type Hugging Face writes beside each architecture trtmoe reads (the registry entries').
_MODEL_TYPES = HF_MODEL_TYPES
# The model types whose sliding window is on only when use_sliding_window is true.
_USE_SLIDING_WINDOW = frozenset(a.hf_model_type for a in ADAPTERS.values() if a.use_sliding_window_key)


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def is_int(v: Any) -> bool:
    """A JSON integer (``64``, or an integral number such as ``64.0``), never a boolean."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v) and v.is_integer())


def validate_hf_config(cfg: Any, path: str | Path = "config.json", *, registry: bool = True) -> dict:
    """Return ``cfg`` when it is a config the adapters can read exactly; else raise
    ``CheckpointError`` (wrong type or value) or ``UnsupportedError`` (a fact no target honours),
    naming the file and key. ``registry=False``: a config outside the registry (read by transformers'
    own model), checked for its values only: no architecture refusal, no registry-specific rules."""
    where = str(path)

    def bad(key: str, what: str, hint: str | None = None) -> CheckpointError:
        return CheckpointError(f"{key} {what}", where=where, hint=hint)

    if not isinstance(cfg, dict):
        raise CheckpointError(f"top level must be a JSON object, got {_kind(cfg)}", where=where)
    archs = cfg.get("architectures")
    if isinstance(archs, str):
        raise bad("architectures", f"must be a list of names, got the string {archs!r}",
                  hint=f'write ["{archs}"]')
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise bad("architectures", f"must be a list of names, got {archs!r}")
    if archs and len(set(archs)) > 1:
        raise bad("architectures", f"names {len(set(archs))} different architectures {archs!r}; a checkpoint "
                  "holds one")
    if registry and archs and not any(a in _SUPPORTED for a in archs):
        # Said first: a value check below (a sliding window, a token id) would send the user to fix a
        # key when no value makes this checkpoint convertible.
        raise UnsupportedError(f"architecture {archs[0]!r} is not supported", where=where,
                               hint="supported: " + ", ".join(supported_architectures()))
    mtype = cfg.get("model_type")
    if registry and archs and isinstance(mtype, str) and _MODEL_TYPES.get(archs[0], mtype) != mtype:
        raise bad("model_type", f"= {mtype!r} contradicts architectures {archs!r} (which Hugging Face "
                  f"writes with model_type {_MODEL_TYPES[archs[0]]!r})")
    for key, low in _INT_FIELDS.items():
        v = cfg.get(key)
        if v is None:
            continue
        if not is_int(v):
            raise bad(key, f"must be an integer, got {_kind(v)} {v!r}")
        if v < low:
            raise bad(key, f"must be at least {low}, got {v!r}")
        high = _COUNT_LIMITS.get(key, _SIZE_LIMIT)
        if v > high:
            raise bad(key, f"= {v!r} is beyond any real model (at most {high})")
    for key in _FLOAT_FIELDS:
        v = cfg.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise bad(key, f"must be a positive number, got {_kind(v)} {v!r}")
    for key in _BOOL_FIELDS:
        v = cfg.get(key)
        if v is not None and not isinstance(v, bool):
            raise bad(key, f"must be true or false, got {_kind(v)} {v!r}")
    for key in _STR_FIELDS:
        v = cfg.get(key)
        if v is not None and not isinstance(v, str):
            raise bad(key, f"must be a string, got {_kind(v)} {v!r}")
    for key in _DICT_FIELDS:
        v = cfg.get(key)
        if v is not None and not isinstance(v, dict):
            raise bad(key, f"must be an object or null, got {_kind(v)} {v!r}")
    only = cfg.get("mlp_only_layers")
    if only is not None and not (isinstance(only, list) and all(is_int(x) for x in only)):
        raise bad("mlp_only_layers", f"must be a list of layer indices, got {only!r}")
    layers = cfg.get("num_hidden_layers")
    if only and layers is not None and not all(0 <= x < layers for x in only):
        raise bad("mlp_only_layers", f"= {only!r} names layers outside 0..{layers - 1}")
    _check_token_ids(cfg, bad)
    _check_rope(cfg, bad)
    if registry:
        _check_sliding_window(cfg, where)
    return cfg


def _check_token_ids(cfg: dict, bad) -> None:
    vocab = cfg.get("vocab_size")
    for key in ("bos_token_id", "eos_token_id"):
        v = cfg.get(key)
        if v is None:
            continue
        ids = v if isinstance(v, list) else [v]
        for i in ids:
            if not is_int(i):
                raise bad(key, f"must be a token id or a list of them, got {v!r}")
            if i < 0 or (vocab is not None and i >= vocab):
                raise bad(key, f"= {i!r} is outside the vocabulary (vocab_size {vocab})")


def _rope_type(d: dict) -> str | None:
    return d.get("rope_type", d.get("type"))


def _check_rope(cfg: dict, bad) -> None:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if params and scaling:
        # Newer configs say the same thing under both names; differing settings leave the model
        # ambiguous, and picking one would silently change its positions.
        norm_p = {("rope_type" if k == "type" else k): v for k, v in params.items()}
        norm_s = {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
        clash = sorted(k for k in set(norm_p) & set(norm_s) if norm_p[k] != norm_s[k])
        if _rope_type(params) != _rope_type(scaling) and "rope_type" not in clash:
            clash.insert(0, "rope_type")
        if clash:
            raise bad("rope_scaling", f"{scaling!r} conflicts with rope_parameters {params!r} "
                      f"(they differ in {', '.join(clash)})")
    for d, name in ((params, "rope_parameters"), (scaling, "rope_scaling")):
        theta = d.get("rope_theta")
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float))
                                  or not math.isfinite(theta) or theta <= 0):
            raise bad(f"{name}.rope_theta", f"must be a positive number, got {theta!r}")
    theta_p, theta_top = params.get("rope_theta"), cfg.get("rope_theta")
    if theta_p is not None and theta_top is not None and float(theta_p) != float(theta_top):
        raise bad("rope_theta", f"= {theta_top!r} conflicts with rope_parameters.rope_theta = {theta_p!r}")


def _check_sliding_window(cfg: dict, where: str) -> None:
    window = cfg.get("sliding_window")
    if not window:  # null or 0: no window
        return
    context = cfg.get("max_position_embeddings") or _DEFAULT_CONTEXT
    # Qwen MoE configs carry a window that is off unless use_sliding_window says so; Mixtral's and
    # Phi-3.5-MoE's attention use any window given (a use_sliding_window key there changes nothing).
    archs = cfg.get("architectures") or []
    qwen = cfg.get("model_type") in _USE_SLIDING_WINDOW or any(_MODEL_TYPES.get(a) in _USE_SLIDING_WINDOW
                                                               for a in archs)
    if qwen and not cfg.get("use_sliding_window"):
        return
    if window < context:
        raise UnsupportedError(
            f"sliding_window = {window} is smaller than the context ({context} tokens); trtmoe's targets "
            "attend over the whole context, which would change the model's outputs past that window",
            where=where, hint="only full attention (sliding_window null or ≥ max_position_embeddings) is converted")
