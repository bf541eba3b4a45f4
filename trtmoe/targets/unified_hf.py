"""The unified-HF targets: a ModelOpt-style quantized Hugging Face checkpoint
(``trtmoe.checkpoint.unified_hf``) that an engine loads as it is, with no build step. One class,
one instance per engine (TensorRT-LLM's PyTorch backend, vLLM, SGLang); each instance's support cells
are the unified-HF support table's rows of its engine releases (``trtmoe.checkpoint.unified_support``)."""

from __future__ import annotations

from ..checkpoint import unified_support as S
from ..checkpoint.unified_hf import write_unified_checkpoint
from ..errors import InputError, NotBuildable
from .base import Target

_FLOAT = (None, "float", "fp16", "bf16", "fp32")


class UnifiedHF(Target):
    """The unified-HF checkpoint for one serving engine. ``releases`` are the engine releases of the
    unified-HF support table whose cells it answers with (default: the table's releases of ``name``),
    the first of them the default."""

    artifact = "unified-hf-checkpoint"

    def __init__(self, name: str, releases: tuple[str, ...] | None = None):
        self.name = name
        self.releases = tuple(releases) if releases else tuple(e for e, (_, t) in S.ENGINES.items() if t == name)
        if not self.releases or any(e not in S.ENGINES for e in self.releases):
            raise ValueError(f"unified-HF target {name!r}: releases {self.releases} are not all in the support table")
        self.label = S.ENGINES[self.releases[0]][0]

    @property
    def default_engine(self) -> str:
        return self.releases[0]

    def engine(self, asked: str | None) -> str:
        """The engine release whose support cells apply: ``asked``, checked to be one of this target's,
        or the default."""
        engine = asked or self.default_engine
        if engine not in self.releases:
            raise InputError(f"engine release {engine!r} is not a {self.name} release",
                             hint="one of " + ", ".join(self.releases))
        return engine

    def support_report(self, *, model=None, family=None, mapping=None, fmt=None, trtllm_version=None, sm=90,
                       engine=None) -> dict | None:
        """The unified-HF cell of ``fmt`` (the routed experts of every MoE layer; None: bf16) for
        ``family`` on SM ``sm`` at release ``engine`` (default: the target's first)."""
        family = family or (model.family if model is not None else None)
        if family not in S.ARCH_LABEL:
            return None
        engine = engine or self.default_engine
        f = "bf16" if fmt in _FLOAT else fmt
        label = S.ENGINES.get(engine, (engine, None))[0]
        if f not in S.FORMATS:
            v = S.Verdict(refusals=[f"{label} x {S.ARCH_LABEL[family]} x {f}: refused: format {f!r} has "
                                    "no unified-HF (ModelOpt) form"], works=S.what_works(engine, family, sm))
        else:
            v = S.check(engine, family, {f}, sm)
        return {"release": engine, "engine_label": label, **v.to_dict(), "what_works": v.works}

    def refusal(self, sup: dict) -> NotBuildable:
        return NotBuildable(f"{sup['engine_label']} does not load this unified-HF export: " + "; ".join(sup["refusals"]),
                            hint=f"what works there: {sup['what_works']}")

    def check(self, engine: str, family: str, formats: set[str], sm: int) -> S.Verdict:
        """The support table's verdict on a plan's formats (``convert`` refuses before any work)."""
        return S.check(engine, family, formats, sm)

    def write(self, model, out, plan=None, **options):
        """``trtmoe.checkpoint.unified_hf.write_unified_checkpoint`` of ``plan`` for this engine."""
        return write_unified_checkpoint(model, out, plan, target=self.name, **options)
