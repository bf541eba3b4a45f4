"""The ``trtllm-pytorch`` / ``vllm`` / ``sglang`` targets: convert to a ModelOpt unified-HF checkpoint,
check it against the support table, and deploy it (Triton's llmapi ``model.yaml``, or the engines' own
command lines).

The checkpoint writer is ``checkpoint/unified_hf.py`` (the numerics: ``quant/formats.py``); the table is
``checkpoint/unified_support.py``. Deploy facts restated from TensorRT-LLM's
``triton_backend/all_models/llmapi/tensorrt_llm/1/model.yaml`` (keys are ``LLM()`` arguments plus a
``triton_config`` block) and ``config.pbtxt`` (inputs ``text_input`` / ``sampling_param_*`` /
``streaming``, outputs ``text_output`` ...): the ``model.py`` that reads them ships in TensorRT-LLM's
container under ``triton_backend/all_models/llmapi/``.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import unified_hf as U
from ..checkpoint import unified_support as S
from ..checkpoint.atomic import atomic_directory
from ..checkpoint.manifest import REPOSITORY_MANIFEST, read_manifest, write_manifest
from ..checkpoint.verify import verify_artifact
from ..errors import InputError
from ..hf.reader import parse_dtype
from ..checkpoint.unified_rounding import UnifiedRounding
from ..quant import awq, fp_gptq
from ..quant.calibrate import load_calib
from ..quant.policies import make_target_plan
from ..targets import names, target_for

REPO_KIND = "triton-repository"


def parse_layer_formats(specs: tuple[str, ...] | list[str]) -> tuple[str | None, dict[int, str], dict[str, str]]:
    """``--layer-format`` values: ``*=FMT`` (every quantizable linear, ModelOpt-preset style), ``L=FMT``
    (MoE layer L's routed experts), ``attention=FMT`` / ``shared=FMT`` / ``dense=FMT``."""
    uniform, experts, other = None, {}, {}
    for s in specs:
        key, sep, fmt = s.partition("=")
        if not sep or not fmt:
            raise InputError(f"--layer-format {s!r}: expected KEY=FORMAT", hint="e.g. '*=fp8', '0=nvfp4', 'attention=fp8'")
        name = U.get_format(fmt).name
        if key == "*":
            uniform = name
        elif key.isdigit():
            experts[int(key)] = name
        elif key in ("attention", "shared", "dense"):
            other[key] = name
        else:
            raise InputError(f"--layer-format {s!r}: unknown key {key!r}",
                             hint="'*', a MoE layer index, 'attention', 'shared' or 'dense'")
    return uniform, experts, other


def moe_layers(model: str | Path) -> list[int]:
    """The decoder layers that hold routed experts."""
    with U.SourceModel(model) as src:
        return sorted({m.layer for m in src.modules() if m.kind == "expert"})


def _model_dtype(src: "U.SourceModel") -> torch.dtype:
    name = src.hf_config.get("torch_dtype") or src.hf_config.get("dtype") or "bfloat16"
    return parse_dtype(name if name in ("float32", "float16", "bfloat16") else "bfloat16")


def build_plan(model: str | Path, specs) -> U.UnifiedPlan:
    uniform, experts, other = parse_layer_formats(specs)
    moe = moe_layers(model)
    bad = sorted(set(experts) - set(moe))
    if bad:
        raise InputError(f"--layer-format names layers {bad} that have no routed experts", hint=f"MoE layers: {moe}")
    if uniform:
        plan = U.UnifiedPlan.uniform(uniform, moe)
    else:
        plan = U.UnifiedPlan({}, {}, {"policy": "per-layer"})
    plan.expert_formats.update(experts)
    plan.other_formats.update(other)
    return plan


def plan_from_calibration(model: str | Path, calib_dir: str | Path | dict, budget_bpw: float, *, engine: str,
                          sm: int, formats: list[str] | None = None) -> tuple[U.UnifiedPlan, dict[str, float]]:
    """The graded per-MoE-layer plan: trtmoe's exact allocator over the formats the support cell
    (engine x architecture x SM) allows per layer, on the calibration's measured ΔKL (``trtmoe calibrate
    --formats fp8,nvfp4,w4a8_awq,...``), each layer costed in the bits this checkpoint stores for it
    (``avg_bpw`` is the written experts' stored bits per weight); plus the input amax of each expert linear from the calibration (one per
    layer and matrix kind). Attention, shared experts and dense MLPs stay bf16 (their own decisions
    through ``--layer-format attention=...``). ``calib_dir`` may be the calibration already read."""
    calib = calib_dir if isinstance(calib_dir, dict) else load_calib(calib_dir)
    with U.SourceModel(model) as src:
        family, dtype = src.family, _model_dtype(src)
        # The budget is the checkpoint's own stored bits per routed-expert weight.
        layer_bits = U.expert_layer_bits(src, ["float", *[f for f in calib["formats"] if f in U.FORMATS]])
    if not S.cell(engine, family, "bf16", "uniform", sm).ok:  # the engine has no model class for it at all
        S.check(engine, family, {"bf16"}, sm).raise_if_refused(where=str(model))
    known = [f for f in calib["formats"] if f in U.FORMATS]
    uniform = ("float", *[f for f in known if S.cell(engine, family, f, "uniform", sm).ok])
    mixed = tuple(f for f in ("float", *known) if S.cell(engine, family, "bf16" if f == "float" else f, "mixed", sm).ok)
    if len(mixed) < 2:
        mixed = ()
    qp = make_target_plan(calib, "graded", budget_bpw=budget_bpw, uniform=uniform, mixed=mixed,
                          dtype=dtype, formats=formats, layer_bits=layer_bits,
                          target=f"{S.ARCH_LABEL[family]} on {S.ENGINES[engine][0]} SM{sm}")
    expert_formats = {}
    for l, fs in qp.formats.items():
        f = fs[0]
        expert_formats[int(l)] = "bf16" if f == "float" else f
    plan = U.UnifiedPlan(expert_formats, {}, {"policy": "graded", "budget_bpw": budget_bpw,
                                             **{k: v for k, v in qp.meta.items() if k in ("avg_bpw", "predicted_delta_kl", "notes")}})
    return plan, calib_input_amax(model, calib)


def calib_input_amax(model: str | Path, calib: dict | str | Path) -> dict[str, float]:
    """Each routed-expert linear's input amax from a calibration (``calib.json`` ``input_amax``: per MoE
    layer, ``fc`` = gate/up input, ``proj`` = down input; per-channel lists reduce to their max)."""
    if not isinstance(calib, dict):
        calib = load_calib(calib)
    with U.SourceModel(model) as src:
        mods, dtype = src.modules(), _model_dtype(src)
    kind_of = {"gate": "fc", "up": "fc", "gate_up": "fc", "down": "proj"}
    amax: dict[str, float] = {}
    measured = calib.get("input_amax") or {}
    for m in mods:
        v = (measured.get(str(m.layer)) or {}).get(kind_of.get(m.expert_role or "", ""))
        if m.kind != "expert" or v is None:
            continue
        # Rounded to the model dtype: the largest |input| a run in that dtype sees (as ModelOpt measures it).
        amax[m.name] = float(torch.tensor(max(v) if isinstance(v, list) else float(v)).to(dtype))
    return amax


def export_rounding(model: str | Path, plan: U.UnifiedPlan, calib: str | Path | None, rounding: str | None,
                    calib_json: dict | None = None) -> UnifiedRounding | None:
    """The rounding the routed experts are written with (recorded in ``plan.meta["rounding"]``): ``rounding``
    or, when None, the calibration's; None (round to nearest) without a calibration, for "rtn", and for a
    plan with no float-format experts. A rounding named without a calibration is refused; the
    calibration's own, when its activation statistics are gone, falls back to round to nearest with a
    note. ``calib_json``: the calibration's calib.json already read."""
    if rounding is not None and rounding not in awq.ROUNDINGS:
        raise InputError(f"unknown rounding {rounding!r}", hint=awq.ROUNDING_HINT)
    if calib is None:
        if rounding not in (None, "rtn"):
            raise InputError(f"--rounding {rounding} needs a calibration with activation statistics",
                             hint="pass --calib CALIB (from `trtmoe calibrate`), or use --rounding rtn")
        return None
    if calib_json is None:
        calib_json = load_calib(calib)
    name = rounding or calib_json.get("rounding") or "rtn"
    fmts = {U.get_format(f).fmt for f in plan.expert_formats.values()}
    if name == "rtn" or not any(fp_gptq.applies(f) for f in fmts):
        plan.meta["rounding"] = "rtn"
        return None
    d = Path(calib)
    if rounding is None and not ((d if d.is_dir() else d.parent) / awq.ACT_FILE).is_file():
        plan.meta["rounding"] = "rtn"
        plan.meta.setdefault("notes", []).append(
            f"the calibration's {name} rounding needs its activation statistics, which are missing: experts "
            "rounded to nearest")
        return None
    with U.SourceModel(model) as src:
        mods = [m for m in src.modules() if m.kind == "expert"]
        dtype = src.info(mods[0].tensor).dtype if mods else _model_dtype(src)
    plan.meta["rounding"] = name
    if awq.stale_float_rounding(calib_json):
        plan.meta.setdefault("notes", []).append(awq.STALE_FLOAT_NOTE.format(name))
    return UnifiedRounding.from_calibration(calib, name, dtype)


@dataclass
class UnifiedConvert:
    result: U.UnifiedResult
    verdict: S.Verdict
    engine: str
    sm: int


def convert_unified(model: str | Path, out: str | Path, *, target: str, layer_formats, engine: str | None = None,
                    sm: int = 90, calib_ids: str | Path | None = None, force: bool = False,
                    calib: str | Path | None = None, budget_bpw: float | None = None, formats: list[str] | None = None,
                    progress=None, rounding: str | None = None) -> UnifiedConvert:
    """Plan (``layer_formats``, or graded from ``calib`` at ``budget_bpw``), consult the support table
    (refusing before any work), take or measure input amax when a format quantizes activations, and
    write the checkpoint. With ``calib`` the routed experts' FP8 / FP8-block / NVFP4 / MXFP4 codes are
    chosen by ``rounding`` (None: the calibration's own, the one its sensitivities were measured with)
    from the calibration's stored inputs; "rtn" rounds to nearest. W4A8-AWQ experts take the pre-quant
    scales and clips the calibration searched, with error-feedback codes under gptq / awq_gptq (rounded
    to nearest, pre-quant scale one, under "rtn")."""
    t = target_for(target)
    if not t.unified:
        raise InputError(f"--target {target} does not write a unified-HF checkpoint",
                         hint="one of " + ", ".join(names(unified=True)))
    engine = t.engine(engine)
    calib_amax: dict[str, float] = {}
    calib_json = None if calib is None else load_calib(calib)  # read once for the plan, amax and rounding
    if budget_bpw is not None:
        if calib is None:
            raise InputError("--budget needs --calib (a calibration that measured the candidate formats)")
        plan, calib_amax = plan_from_calibration(model, calib_json, budget_bpw, engine=engine, sm=sm,
                                                 formats=formats)
        extra = build_plan(model, layer_formats) if layer_formats else None
        if extra is not None:
            plan.other_formats.update(extra.other_formats)
    else:
        plan = build_plan(model, layer_formats)
        if calib is not None:
            calib_amax = calib_input_amax(model, calib_json)
    with U.SourceModel(model) as src:
        family = src.family
    verdict = t.check(engine, family, plan.used(), sm)
    verdict.raise_if_refused(where=str(model))
    rnd = export_rounding(model, plan, calib, rounding, calib_json)
    amax = None
    needs = [m for m in plan.used() if U.get_format(m).activations]
    expert_only = all(not U.get_format(f).activations for f in plan.other_formats.values())
    if needs and calib_amax and expert_only and calib_ids is None:
        amax = calib_amax  # the calibration's per-layer expert input amax
    elif needs:
        if calib_ids is None:
            raise InputError("this plan quantizes activations (FP8 / NVFP4) and needs calibration token ids",
                             hint="pass --calib-ids FILE (a JSON list of token-id lists), or weight-only formats")
        try:
            ids = json.loads(Path(calib_ids).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"cannot read calibration ids: {e}", where=str(calib_ids)) from None
        if not (isinstance(ids, list) and ids and all(isinstance(r, list) and r for r in ids)):
            raise InputError("calibration ids must be a non-empty JSON list of non-empty token-id lists",
                             where=str(calib_ids))
        amax = U.measure_input_amax(model, ids)
    w4 = None
    if calib is not None and any(awq.applies(U.get_format(f).fmt) for f in plan.used()):
        with U.SourceModel(model) as src:
            dtype = _model_dtype(src)
        w4 = awq.checkpoint_rounding(calib, calib_json, dtype, rounding)  # the searched W4A8 recipes
        if w4 is not None and w4.rounding in awq.ERROR_FEEDBACK and awq.stale_w4a8_codes(calib_json):
            plan.meta.setdefault("notes", []).append(awq.STALE_W4A8_NOTE.format(w4.rounding))
    res = t.write(model, out, plan, input_amax=amax, force=force, progress=progress,
                  extra_manifest={"support": verdict.to_dict(), "engine": engine, "sm": sm,
                                  **({"rounding": w4.rounding} if w4 else {})},
                  rounding=w4, fp_rounding=rnd)
    return UnifiedConvert(res, verdict, engine, sm)


# ---- deploy --------------------------------------------------------------------------------------

DEFAULT_BUILD = {"max_batch_size": 64, "max_num_tokens": 8192, "max_seq_len": 4096,
                 "free_gpu_memory_fraction": 0.9, "enable_block_reuse": True}


def model_yaml(checkpoint: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1, build: dict | None = None,
               decoupled: bool = True) -> str:
    """Triton llmapi ``model.yaml``: ``LLM()`` arguments for the checkpoint plus ``triton_config``."""
    b = {**DEFAULT_BUILD, **(build or {})}
    lines = [
        "# LLM() arguments (tensorrt_llm.llmapi.LLM), read by triton_backend/all_models/llmapi/tensorrt_llm/1/model.py",
        f"model: {json.dumps(str(Path(checkpoint).absolute()))}",
        'backend: "pytorch"',
        f"tensor_parallel_size: {tp}",
        f"pipeline_parallel_size: {pp}",
        f"moe_expert_parallel_size: {ep}",
        f"max_batch_size: {b['max_batch_size']}",
        f"max_num_tokens: {b['max_num_tokens']}",
        f"max_seq_len: {b['max_seq_len']}",
        "kv_cache_config:",
        f"  free_gpu_memory_fraction: {b['free_gpu_memory_fraction']}",
        f"  enable_block_reuse: {str(bool(b['enable_block_reuse'])).lower()}",
        "triton_config:",
        "  max_batch_size: 0",
        f"  decoupled: {str(decoupled)}",
    ]
    return "\n".join(lines) + "\n"


# The llmapi model's inputs and outputs (name, Triton type, dims, optional), restated from upstream's
# triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt (its multimodal and LoRA inputs left out: a
# trtmoe checkpoint has neither). Every output model.py may send is declared: Triton refuses an undeclared one.
LLMAPI_INPUTS = (
    ("text_input", "TYPE_STRING", "-1", False), ("streaming", "TYPE_BOOL", "1", True),
    ("sampling_param_best_of", "TYPE_INT32", "1", True), ("sampling_param_temperature", "TYPE_FP32", "1", True),
    ("sampling_param_top_k", "TYPE_INT32", "1", True), ("sampling_param_top_p", "TYPE_FP32", "1", True),
    ("sampling_param_frequency_penalty", "TYPE_FP32", "1", True),
    ("sampling_param_presence_penalty", "TYPE_FP32", "1", True),
    ("sampling_param_max_tokens", "TYPE_INT32", "1", True), ("sampling_param_stop", "TYPE_STRING", "-1", True),
    ("sampling_param_seed", "TYPE_UINT64", "1", True),
    ("sampling_param_exclude_input_from_output", "TYPE_BOOL", "1", True),
    ("sampling_param_return_perf_metrics", "TYPE_BOOL", "1", True),
    ("return_finish_reason", "TYPE_BOOL", "1", True), ("return_stop_reason", "TYPE_BOOL", "1", True),
    ("return_cumulative_logprob", "TYPE_BOOL", "1", True), ("stop", "TYPE_BOOL", "1", True),
)
LLMAPI_OUTPUTS = (
    ("text_output", "TYPE_STRING", "-1"), ("finish_reason", "TYPE_STRING", "-1"), ("stop_reason", "TYPE_STRING", "-1"),
    ("cumulative_logprob", "TYPE_FP32", "-1"), ("kv_cache_reused_block", "TYPE_INT32", "-1"),
    ("kv_cache_missed_block", "TYPE_INT32", "-1"), ("kv_cache_alloc_new_blocks", "TYPE_INT32", "-1"),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", "-1"), ("kv_cache_hit_rate", "TYPE_FP32", "-1"),
    ("arrival_time_ns", "TYPE_INT64", "1"), ("first_scheduled_time_ns", "TYPE_INT64", "1"),
    ("first_token_time_ns", "TYPE_INT64", "1"), ("last_token_time_ns", "TYPE_INT64", "1"),
    ("acceptance_rate", "TYPE_FP32", "1"), ("total_accepted_draft_tokens", "TYPE_INT32", "1"),
    ("total_draft_tokens", "TYPE_INT32", "1"),
)


def llmapi_config_pbtxt(decoupled: bool) -> str:
    """``tensorrt_llm/config.pbtxt`` for upstream's llmapi model.py. Batch size and decoupling are written
    here as well as in model.yaml's ``triton_config``: upstream's launch script starts Triton with
    ``--disable-auto-complete-config``, so model.py cannot set them from model.yaml there."""
    ins = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ]{" optional: true" if o else ""} }}'
                      for n, t, d, o in LLMAPI_INPUTS)
    outs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ] }}' for n, t, d in LLMAPI_OUTPUTS)
    return (f'name: "tensorrt_llm"\nbackend: "python"\nmax_batch_size: 0\n'
            f"model_transaction_policy {{ decoupled: {str(decoupled).lower()} }}\n"
            f"input [\n{ins}\n]\noutput [\n{outs}\n]\ninstance_group [ {{ count: 1 kind: KIND_CPU }} ]\n")


def write_llmapi_repository(checkpoint: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
                            build: dict | None = None, force: bool = False) -> dict:
    """A Triton repository in upstream's llmapi layout for a verified unified-HF checkpoint: one
    ``tensorrt_llm`` model (``config.pbtxt``, ``1/model.yaml``); ``1/model.py`` and the ``helpers.py`` it
    imports are upstream's, taken on the GPU host from the TensorRT-LLM tag matching the container's
    tensorrt_llm (``trtmoe serve --print-command`` shows how)."""
    ck = Path(checkpoint)
    info = verify_artifact(ck)
    if info["kind"] != U.KIND:
        raise InputError(f"{ck} is a {info['kind']}, not a unified-HF checkpoint",
                         hint="convert with --target trtllm-pytorch (or vllm / sglang) first")
    man = read_manifest(ck)
    with atomic_directory(out, force=force, inputs=(ck,)) as tmp:
        (tmp / "tensorrt_llm" / "1").mkdir(parents=True)
        (tmp / "tensorrt_llm" / "config.pbtxt").write_text(llmapi_config_pbtxt(True))
        (tmp / "tensorrt_llm" / "1" / "model.yaml").write_text(model_yaml(ck, tp=tp, pp=pp, ep=ep, build=build))
        manifest = write_manifest(tmp, kind=REPO_KIND, file_hashes={}, name=REPOSITORY_MANIFEST, layout="llmapi",
                                  contract="TensorRT-LLM triton_backend llmapi (PyTorch backend)",
                                  checkpoint=str(ck.absolute()), checkpoint_manifest_target=man.get("target"),
                                  engine=man.get("engine"), mapping={"tp": tp, "pp": pp, "ep": ep},
                                  model_py="triton_backend/all_models/llmapi/tensorrt_llm/1/model.py and helpers.py "
                                           "from the TensorRT-LLM tag matching the container's tensorrt_llm")
    return manifest


def gpu_commands(checkpoint: str | Path, *, tp: int = 1, ep: int = 1, port: int = 8000, build: dict | None = None,
                 repo: str | Path | None = None) -> dict[str, str]:
    """The command lines that serve the checkpoint on a GPU host: trtllm-serve, vLLM, SGLang (and
    Triton with the llmapi repository when ``repo`` is given)."""
    b = {**DEFAULT_BUILD, **(build or {})}
    ck = shlex.quote(str(Path(checkpoint).absolute()))
    cmds = {
        "trtllm-serve": (f"trtllm-serve {ck} --host 0.0.0.0 --backend pytorch --tp_size {tp} --ep_size {ep} "
                         f"--max_batch_size {b['max_batch_size']} --max_num_tokens {b['max_num_tokens']} "
                         f"--max_seq_len {b['max_seq_len']} --kv_cache_free_gpu_memory_fraction "
                         f"{b['free_gpu_memory_fraction']} --port {port}"),
        "vllm": (f"vllm serve {ck} --quantization modelopt_mixed --tensor-parallel-size {tp}"
                 f"{' --enable-expert-parallel' if ep > 1 else ''} --max-num-seqs {b['max_batch_size']} "
                 f"--max-model-len {b['max_seq_len']} --gpu-memory-utilization {b['free_gpu_memory_fraction']} "
                 f"--port {port}"),
        "sglang": (f"python -m sglang.launch_server --model-path {ck} --host 0.0.0.0 --quantization modelopt_mixed --tp {tp}"
                   f"{f' --ep-size {ep}' if ep > 1 else ''} --max-running-requests {b['max_batch_size']} "
                   f"--context-length {b['max_seq_len']} --mem-fraction-static {b['free_gpu_memory_fraction']} "
                   f"--port {port}"),
    }
    hq = Path(checkpoint) / "hf_quant_config.json"  # absent for gpt-oss (config.json describes its MXFP4)
    q = json.loads(hq.read_text())["quantization"]["quant_algo"] if hq.is_file() else None
    if q != "MIXED_PRECISION":  # one format: vLLM / SGLang read it from the checkpoint's quantization_config
        cmds["vllm"] = cmds["vllm"].replace(" --quantization modelopt_mixed", "")
        cmds["sglang"] = cmds["sglang"].replace(" --quantization modelopt_mixed", "")
    if repo is not None:
        # Upstream's llmapi backend (model.py and the helpers.py it imports) is taken from the TensorRT-LLM
        # tag matching the container's tensorrt_llm, and started with its launch script (run from the
        # clone's parent, which passes --disable-auto-complete-config: config.pbtxt carries the settings).
        r = shlex.quote(str(Path(repo).absolute()))
        src = "TensorRT-LLM/triton_backend/all_models/llmapi/tensorrt_llm/1"
        cmds["triton"] = ("git clone --depth 1 --branch "
                          "v$(python3 -c 'import tensorrt_llm; print(tensorrt_llm.__version__)') "
                          "https://github.com/NVIDIA/TensorRT-LLM.git && "
                          f"cp {src}/model.py {src}/helpers.py {r}/tensorrt_llm/1/ && "
                          f"python3 TensorRT-LLM/triton_backend/scripts/launch_triton_server.py --model_repo={r} "
                          f"--http_port {port}")
    return cmds
