"""Checkpoint tensor names as transformers' loader maps them onto the modules it builds."""

from __future__ import annotations

from typing import Callable


def loaded_name(mapping) -> Callable[[str], str]:
    """What a checkpoint tensor's name becomes in the module tree transformers' loader fills, under the
    model's conversion ``mapping`` (renamings such as a hub ``shared_expert`` loading as ``shared_experts``,
    and converters such as per-expert tensors fused into one): the name as written where this transformers
    has no renaming function."""
    try:
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # pragma: no cover - transformers 5 has it
        return lambda name: name
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
    return lambda name: rename_source_key(name, renamings, converters)[0]
