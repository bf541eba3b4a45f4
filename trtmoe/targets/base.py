"""What every deployment target answers: the base class of trtmoe's targets.

A target is what ``convert`` writes a checkpoint for and what the later stages build and serve it
with. Each one owns the decisions that differ between them: its support cells (which architecture,
format and layout its engine runs), how a quantization plan is cut for it (granularity, candidate
formats, who rounds float weights), whether calibration scores the group-int4 weights stacked, its
checkpoint writer, and its build step (the backend an engine directory records, what the memory
estimate counts, which build settings it checks). Callers ask the object; none compares names.
"""

from __future__ import annotations

from ..errors import NotBuildable


class Target:
    """One deployment target. Subclasses set the attributes and override what differs."""

    name: str = ""
    label: str = ""
    # The artifact ``convert`` writes: a TensorRT-LLM checkpoint (``trtllm-checkpoint``) or a
    # unified-HF checkpoint (``unified-hf-checkpoint``).
    artifact: str = "trtllm-checkpoint"
    # ``calibrate --target`` accepts it (the targets whose plans trtmoe's calibration scores).
    calibrates: bool = False
    # Calibration scores the group-wise int4 formats with one pre-quant scale per MoE layer (the
    # stacked layout the target's engine builder writes), not one per expert matrix.
    stacked_scoring: bool = False
    # The engine runs one format per MoE layer only (no per-expert or per-matrix formats).
    layer_only: bool = False
    # Who rounds the float weights of the layer layout's per-channel formats to nearest.
    rounder: str = "engine"
    # ``build``'s backend for this target's checkpoints (the engine directory's ``backend``); None
    # when the serving engines load the checkpoint as it is (no build step).
    build_backend: str | None = None
    # The build's memory estimate is per GPU (each rank its own process) rather than for one process.
    per_rank_memory: bool = False

    @property
    def unified(self) -> bool:
        """Whether ``convert`` writes a unified-HF checkpoint for it."""
        return self.artifact == "unified-hf-checkpoint"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # ---- quantization plan ------------------------------------------------------------------------
    def plan_granularity(self, asked: str, policy: str, budgeted: bool) -> str:
        """The format unit of a plan: ``asked``, or for ``auto`` the finest the target runs for the
        policy (``budgeted``: a policy that spends a bit budget). Uniform plans are layer-uniform
        anyway and are written in the layer form; budgeted ones per matrix (fc and proj apart);
        frequency tiers per expert. Raises UnsupportedError where the target cannot run it."""
        if asked != "auto":
            return asked
        if policy == "uniform":
            return "layer"
        return "matrix" if budgeted else "expert"

    def support_options(self, trtllm_version: str, family: str):
        """The formats a budgeted plan may choose from per MoE layer (``support.Options``), when the
        target's support table restricts them; None where any format the calibration scored runs."""
        return None

    def plan_label(self, family: str, options) -> str:
        """What a plan over ``support_options`` is for, as its notes name it."""
        return f"{family} on {self.label}"

    # ---- support cells ----------------------------------------------------------------------------
    def support_report(self, *, model=None, family: str | None = None, mapping=None, fmt: str | None = None,
                       trtllm_version: str | None = None, sm: int = 90, engine: str | None = None) -> dict | None:
        """The target's support cell for a model, layout and routed-expert format, as ``inspect``
        reports it (``ok``, ``refusals``, ``cautions``, ``what_works`` and the release), or None where
        the target has no table to consult (it runs whatever the layout checks allow)."""
        return None

    def refusal(self, support: dict) -> NotBuildable:
        """The one-line error for a refused ``support_report``."""
        return NotBuildable(f"{self.label} does not run this layout and format: " + "; ".join(support["refusals"]),
                            hint=f"it runs {support['what_works']}")

    # ---- checkpoint -------------------------------------------------------------------------------
    def write(self, model, out, **options):
        """Write the target's checkpoint of ``model`` into ``out`` (atomically)."""
        raise NotImplementedError(f"{self.name} has no checkpoint writer")

    # ---- build --------------------------------------------------------------------------------------
    @property
    def memory_scope(self) -> str:
        """Whom the build's memory estimate is for."""
        return "per GPU" if self.per_rank_memory else f"{self.label} process"

    def chunks_prompts(self, build: dict) -> bool:
        """Whether the engine built with ``build`` processes a prompt longer than max_num_tokens in chunks."""
        return False

    def no_chunking_reason(self) -> str:
        """Why a prompt must fit max_num_tokens when ``chunks_prompts`` is false."""
        return f"; the {self.label} does not chunk prompts)"

    def check_build(self, build: dict, dtype: str, problems: list[str], notes: list[str]) -> None:
        """Add the target's own contradictions in the build settings to ``problems`` (and remarks to
        ``notes``), beyond the checks every target shares."""
