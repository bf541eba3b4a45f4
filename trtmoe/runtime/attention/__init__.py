"""Attention kinds of the embedded engine, one module each, looked up by the model's attention kind.

A kind is a class built from a layer's tensors by rule-table role (``from_roles(cfg, tensors, vec,
mat)``) whose instance maps ``(x, rope, cache, seqs, plan)`` to the attention output (see
``gqa.GroupedQueryAttention``). A new kind (multi-head latent attention, say) is one more module
here and one entry in ``KINDS``, keyed by the name the model description gives it.
"""

from __future__ import annotations

from ...errors import UnsupportedError
from . import gqa

KINDS: dict[str, type] = {gqa.KIND: gqa.GroupedQueryAttention}


def kind_of(cfg) -> str:
    """The attention kind of ``cfg`` (a ModelSpec): its ``attention_kind`` where it names one, else
    grouped-query attention, which every architecture the registry holds uses."""
    return getattr(cfg, "attention_kind", None) or gqa.KIND


def attention_for(cfg, tensors: dict, vec, mat):
    """One layer's attention of ``cfg``'s kind, from its tensors by role."""
    kind = kind_of(cfg)
    cls = KINDS.get(kind)
    if cls is None:
        raise UnsupportedError(f"attention kind {kind!r} is not supported by the embedded engine "
                               f"(it runs {', '.join(sorted(KINDS))})")
    return cls.from_roles(cfg, tensors, vec, mat)
