"""Generate a Triton model repository for an engine directory, from the engine's own config.

The repository follows the ``inflight_batcher_llm`` contract of TensorRT-LLM 1.2.x's Triton backend:
``ensemble`` (preprocessing -> tensorrt_llm -> postprocessing), ``preprocessing``, ``tensorrt_llm``,
``postprocessing`` and ``tensorrt_llm_bls``. Input names are the 1.2.x ones, ``min_tokens`` and
``seed``; the older names ``min_length`` / ``random_seed`` (tensorrtllm_backend <= v0.19.0, sent by
its clients and by genai-perf's deterministic output mode) are accepted too: the ensemble and BLS
pass both to preprocessing, which merges each pair into the 1.2 input, and the embedded engine's
``tensorrt_llm`` model reads either.

* ``tensorrt_llm`` uses ``backend: "tensorrtllm"`` for a TensorRT-LLM engine dir, and a Python model
  running trtmoe's embedded engine behind an in-flight batcher for an embedded engine dir; the
  inputs and outputs are the same.
* Values come from the engine's ``config.json`` (max batch size, beam width, input/sequence limits,
  logits dtype, world size); requested settings that contradict it are rejected naming the field.
* Defaults are upstream's: not decoupled (unary ModelInfer and HTTP ``/infer`` work) and
  ``exclude_input_in_output`` false (a non-streamed completion starts with the prompt).
  ``streaming=True`` (``trtmoe repo --streaming``) makes ``tensorrt_llm`` and ``tensorrt_llm_bls``
  decoupled, and with them the ensemble; ``exclude_input_in_output=True`` (``--exclude-input``)
  leaves the prompt out.
* ``text_output`` is 1-D per request (one string per batch item and beam), as upstream's
  postprocessing returns it.
* The tokenizer is copied into ``preprocessing/tokenizer`` as ``tokenizer.json`` (converted once
  here when the source has only a SentencePiece model, which needs the ``tokenizer`` extra), plus
  ``trtmoe_tokenizer.json`` with its special-token ids; pre/postprocessing load it with the
  ``tokenizers`` library alone (no transformers or torch in those processes).
* No absolute path is stored for the embedded engine: ``engine_dir`` and the manifest's paths are
  relative to the repository, so a repository moved together with its engine still serves. (The
  TensorRT-LLM C++ backend opens ``gpt_model_path`` as given, so that one stays absolute: the engine's
  own path, or ``engine_path`` (``--engine-path``), where the engine will be on the serving machine.)
* The embedded engine's torch intra-op threads default to this machine's cores less one per two
  Python-backend instances (pre/post/BLS, each one thread), at least 1; the number is written to
  ``config.pbtxt`` (``torch_num_threads``) and capped at load by the serving machine's cores.
* Every ``config.pbtxt`` is checked for leftover ``${`` and parsed back with Triton's ``ModelConfig``
  protobuf schema; the ensemble's wiring is checked against its steps' declared tensors. The whole
  repository is written to a temporary sibling and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import string
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import __version__
from ..checkpoint.atomic import atomic_directory, source_tree, stays_inside
from ..checkpoint.manifest import REPOSITORY_MANIFEST, manifest_file, read_manifest, write_manifest
from ..errors import BackendUnavailable, InputError, TrtmoeError
from ..hf.hashing import sha256_file
from . import cancel_channel
from .cpu_binding import AUTO as AUTO_CORES
from .cpu_binding import allowed_cores, format_cores, parse_cores
from .engine_dir import EMBEDDED, TENSORRT_LLM, EngineInfo, read_engine_dir

MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
# Models that send cancels to tensorrt_llm's socket, and the name they import its module by.
CANCEL_SENDERS = ("postprocessing", "tensorrt_llm_bls")
CANCEL_MODULE = "trtmoe_cancel_channel.py"
TOKENIZER_SUBDIR = "preprocessing/tokenizer"  # relative to the repository root
MANIFEST = REPOSITORY_MANIFEST
TRTLLM_CONTRACT = "TensorRT-LLM 1.2.x triton_backend inflight_batcher_llm"
# The other layout: one `tensorrt_llm` model, text in and text out (upstream's all_models/llmapi contract),
# for the embedded engine. Its templates live under model_repo/llmapi/.
LAYOUTS = ("inflight", "llmapi")
LLMAPI_MODELS = ("tensorrt_llm",)
LLMAPI_TOKENIZER_SUBDIR = "tensorrt_llm/tokenizer"
LLMAPI_CONTRACT = "TensorRT-LLM 1.2.x triton_backend llmapi"

# Files of an HF folder that are weights, never tokenizer data.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".npz")
_MAX_TOKENIZER_FILE = 64 << 20

ENGINE_WEIGHTS = ("checkpoint", "compute")  # the embedded engine's weight modes (EmbeddedEngine WEIGHT_MODES)

_DTYPE_TO_TRITON = {"float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float32": "TYPE_FP32"}


def templates_dir() -> Path:
    """The ``model_repo/`` templates: ``$TRTMOE_MODEL_REPO_TEMPLATES`` or the project's own folder."""
    env = os.environ.get("TRTMOE_MODEL_REPO_TEMPLATES")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [here.parents[2] / "model_repo", here.parents[1] / "model_repo"]
    for c in candidates:
        if (c / "ensemble" / "config.pbtxt").is_file():
            return c
    raise TrtmoeError("Triton templates (model_repo/) not found",
                      hint="set TRTMOE_MODEL_REPO_TEMPLATES to the model_repo folder of the trtmoe source tree")


@dataclass(frozen=True)
class Limits:
    """Lengths in tokens, batch in requests; None: the engine's build_config (never more than it)."""

    max_batch_size: int | None = None
    max_beam_width: int | None = None  # must equal the engine's
    max_input_len: int | None = None
    max_seq_len: int | None = None
    world_size: int | None = None  # must equal the engine's launch world size


@dataclass(frozen=True)
class Scheduling:
    """How requests are queued, batched and answered."""

    streaming: bool = False  # decoupled tensorrt_llm / BLS / ensemble
    exclude_input_in_output: bool = False  # the default for requests that do not send it
    max_queue_delay_microseconds: int = 0
    max_queue_size: int = 0
    stream_interval: int | None = None  # embedded engine: tokens per streamed response; None / 0 = auto


@dataclass(frozen=True)
class Instances:
    """Python model instances of the ensemble layout."""

    preprocessing_instance_count: int = 1
    postprocessing_instance_count: int = 1
    bls_instance_count: int = 1


@dataclass(frozen=True)
class TokenizerSettings:
    tokenizer_dir: str | Path | None = None  # None: found beside the engine or its checkpoint
    trust_remote_code: bool = False  # always refused; named so that asking for it gets a clear error
    add_special_tokens: bool = True
    skip_special_tokens: bool = True


@dataclass(frozen=True)
class Placement:
    """Where the engine runs and what it may use there."""

    device: str | None = None  # embedded engine: auto, cpu, cuda, cuda:N
    torch_num_threads: int = 0  # embedded engine; 0: chosen from the cores
    decode_cores: str | None = None  # embedded engine: "auto", "none" or a core list (trtmoe.triton.cpu_binding)
    kv_cache_free_gpu_mem_fraction: float | None = None  # TensorRT engines only
    engine_path: str | None = None  # TensorRT-LLM engines: gpt_model_path where served
    weights: str = "checkpoint"  # embedded engine: its weight matrices' dtype (EmbeddedEngine.from_checkpoint)


_GROUPS = {"limits": Limits, "scheduling": Scheduling, "instances": Instances, "tokenizer": TokenizerSettings,
           "placement": Placement}


@dataclass(frozen=True)
class RepositorySettings:
    """What a repository is asked to be (``generate_repository``), grouped; ``resolve_settings`` checks
    it against the engine and fills the defaults into a ``RepoSettings``. ``layout``: one of
    ``LAYOUTS``; ``templates``: the model_repo template folder (default: ``templates_dir()``)."""

    limits: Limits = field(default_factory=Limits)
    scheduling: Scheduling = field(default_factory=Scheduling)
    instances: Instances = field(default_factory=Instances)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    placement: Placement = field(default_factory=Placement)
    layout: str = "inflight"
    templates: str | Path | None = None

    @classmethod
    def from_options(cls, **options: Any) -> "RepositorySettings":
        """From flat option names (the ``repo:`` config section's and ``trtmoe repo``'s, with
        ``tokenizer_dir`` for the tokenizer folder)."""
        return cls().with_options(**options)

    def with_options(self, **options: Any) -> "RepositorySettings":
        """A copy with the flat-named options replaced; an unknown name raises InputError."""
        groups: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        for name, value in options.items():
            where = next((g for g, c in _GROUPS.items() if name in c.__dataclass_fields__), None)
            if where is not None:
                groups.setdefault(where, {})[name] = value
            elif name in ("layout", "templates"):
                top[name] = value
            else:
                raise InputError(f"unknown repository setting {name!r}")
        return replace(self, **top, **{g: replace(getattr(self, g), **kv) for g, kv in groups.items()})

    def options(self) -> dict[str, Any]:
        """Every setting by its flat name."""
        out = {"layout": self.layout, "templates": self.templates}
        for g in _GROUPS:
            out.update(asdict(getattr(self, g)))
        return out


@dataclass(frozen=True)
class RepoSettings:
    """Resolved repository settings (``RepositorySettings`` checked against the engine, its defaults
    filled in): what the templates and the manifest receive. Lengths in tokens."""

    max_batch_size: int
    max_beam_width: int
    max_input_len: int
    max_seq_len: int
    streaming: bool = False
    exclude_input_in_output: bool = False
    max_queue_delay_microseconds: int = 0
    max_queue_size: int = 0
    preprocessing_instance_count: int = 1
    postprocessing_instance_count: int = 1
    bls_instance_count: int = 1
    accumulate_tokens: bool = True
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    trust_remote_code: bool = False
    kv_cache_free_gpu_mem_fraction: float | None = None
    device: str = "auto"
    torch_num_threads: int = 0  # embedded engine; resolved from the cores when not given
    decode_cores: str | None = None  # embedded engine: the decode thread's cores (trtmoe.triton.cpu_binding)
    stream_interval: int = 0  # embedded engine: tokens per streamed response, 0 = auto
    engine_path: str | None = None  # TensorRT-LLM engines: gpt_model_path where served; None = the engine's path
    weights: str = "checkpoint"  # embedded engine: "checkpoint" or "compute" (EmbeddedEngine.from_checkpoint)

    @property
    def decoupled(self) -> bool:
        return self.streaming


@dataclass
class RepositoryResult:
    """What ``generate_repository`` wrote."""

    path: Path
    engine: EngineInfo
    settings: RepoSettings
    models: list[str]
    tokenizer_dir: Path
    launch_world_size: int
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    warnings: list[str] = field(default_factory=list)
    layout: str = "inflight"  # one of LAYOUTS


def _contradiction(field_name: str, requested: Any, engine_value: Any, cfg: Path, why: str) -> InputError:
    return InputError(f"{field_name} {requested} contradicts the engine's build_config.{field_name} {engine_value}",
                      where=str(cfg), hint=why)


def resolve_settings(info: EngineInfo, settings: RepositorySettings | None = None) -> RepoSettings:
    """Merge requested settings with the engine's limits; raise InputError naming a contradicting field.
    The checks run in this order, so that of several problems the same one is named first."""
    rest = (settings or RepositorySettings()).options()
    for name in ("tokenizer_dir", "layout", "templates"):  # not settings of the models
        rest.pop(name)
    limits = {k: rest.pop(k) for k in ("max_batch_size", "max_beam_width", "max_input_len", "max_seq_len",
                                       "world_size")}
    streaming = rest.pop("streaming")
    kv_fraction, device = rest.pop("kv_cache_free_gpu_mem_fraction"), rest.pop("device")
    _check_counts(limits, rest)
    _check_engine_limits(info, **limits)
    _check_runtime_options(info, kv_fraction, device, rest)
    _resolve_decode_cores(info, rest)
    _check_weights_and_engine_path(info, rest)
    rest = {k: v for k, v in rest.items() if v is not None}
    if info.backend == EMBEDDED and not rest.get("torch_num_threads"):
        rest["torch_num_threads"] = default_torch_threads(
            sum(rest.get(k, 1) for k in ("preprocessing_instance_count", "postprocessing_instance_count",
                                         "bls_instance_count")))
    return RepoSettings(max_batch_size=limits["max_batch_size"] or info.max_batch_size,
                        max_beam_width=info.max_beam_width,
                        max_input_len=limits["max_input_len"] or info.max_input_len,
                        max_seq_len=limits["max_seq_len"] or info.max_seq_len,
                        streaming=streaming, kv_cache_free_gpu_mem_fraction=kv_fraction,
                        device=device or "auto", **rest)


def _check_counts(limits: dict, rest: dict) -> None:
    """Limits and instance counts at least 1; delays, queue sizes, thread counts and intervals at least 0."""
    for name, value in limits.items():
        if value is not None and value < 1:
            raise InputError(f"{name} must be >= 1, got {value}")
    for name in ("preprocessing_instance_count", "postprocessing_instance_count", "bls_instance_count"):
        if rest.get(name) is not None and rest[name] < 1:
            raise InputError(f"{name} must be >= 1, got {rest[name]}")
    for name in ("max_queue_delay_microseconds", "max_queue_size", "torch_num_threads", "stream_interval"):
        if rest.get(name) is not None and rest[name] < 0:
            raise InputError(f"{name} must be >= 0, got {rest[name]}")


def _check_engine_limits(info: EngineInfo, *, max_batch_size, max_beam_width, max_input_len, max_seq_len,
                         world_size) -> None:
    """The limits asked for against what the engine was built with (its config.json)."""
    cfg = info.path / "config.json"
    if max_batch_size is not None and max_batch_size > info.max_batch_size:
        raise _contradiction("max_batch_size", max_batch_size, info.max_batch_size, cfg,
                             "the engine cannot batch more than it was built for; rebuild it with a larger "
                             "--max-batch-size or ask for at most that")
    if max_beam_width is not None and max_beam_width != info.max_beam_width:
        raise _contradiction("max_beam_width", max_beam_width, info.max_beam_width, cfg,
                             "Triton's max_beam_width must equal the engine's")
    for name, value, limit in (("max_input_len", max_input_len, info.max_input_len),
                               ("max_seq_len", max_seq_len, info.max_seq_len)):
        if value is None:
            continue
        if value > limit:
            raise _contradiction(name, value, limit, cfg, f"{name} is a build-time limit; rebuild the engine to raise it")
        if value < limit and info.backend == TENSORRT_LLM:
            raise _contradiction(name, value, limit, cfg,
                                 f"the tensorrtllm backend takes {name} from the engine; it is not a runtime setting")
    if world_size is not None and world_size != info.launch_world_size:
        what = ("mapping.world_size (tp_size x pp_size)" if info.backend == TENSORRT_LLM
                else "the embedded engine's process count (it always runs as one process)")
        raise InputError(f"world_size {world_size} contradicts {what} = {info.launch_world_size}", where=str(cfg))


def _check_runtime_options(info: EngineInfo, kv_fraction: float | None, device: str | None, rest: dict) -> None:
    """Options that apply to one kind of engine only, and their ranges."""
    if info.backend == EMBEDDED and kv_fraction is not None:
        raise InputError("kv_cache_free_gpu_mem_fraction applies to TensorRT engines only; the embedded engine "
                         "allocates each sequence's cache itself")
    if kv_fraction is not None and not 0.0 < kv_fraction <= 1.0:
        raise InputError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {kv_fraction}")
    if info.backend == TENSORRT_LLM and device not in (None, "auto"):
        raise InputError("device applies to the embedded engine only; TensorRT engines are placed by MPI rank")
    if device is not None and not (device in ("auto", "cpu", "cuda") or
                                   (device.startswith("cuda:") and device[5:].isdigit())):
        raise InputError(f"device {device!r} is not one of auto, cpu, cuda, cuda:N")
    if info.backend == TENSORRT_LLM and rest.get("torch_num_threads"):
        raise InputError("torch_num_threads applies to the embedded engine only")
    if info.backend == TENSORRT_LLM and rest.get("stream_interval") not in (None, 1):
        raise InputError("stream_interval applies to the embedded engine only; the TensorRT-LLM backend "
                         "streams every token")


def _resolve_decode_cores(info: EngineInfo, rest: dict) -> None:
    """``rest["decode_cores"]`` parsed and written back in its canonical form; with a core list, one
    intra-op thread per core unless fewer threads were asked for."""
    cores = parse_cores(rest.get("decode_cores"))
    if cores is not None and info.backend == TENSORRT_LLM:
        raise InputError("decode_cores applies to the embedded engine only; the TensorRT-LLM backend runs its own "
                         "threads")
    if isinstance(cores, list):
        if not rest.get("torch_num_threads"):
            rest["torch_num_threads"] = len(cores)  # one intra-op thread per decode core
        elif rest["torch_num_threads"] > len(cores):
            raise InputError(f"torch_num_threads {rest['torch_num_threads']} is more than the {len(cores)} decode "
                             f"core(s) {format_cores(cores)}: the threads would take turns on them",
                             hint="give as many cores as threads, or fewer threads")
    rest["decode_cores"] = None if cores is None else (cores if cores == AUTO_CORES else format_cores(cores))


def _check_weights_and_engine_path(info: EngineInfo, rest: dict) -> None:
    """How the embedded engine holds its weights, and where a TensorRT-LLM repository finds its engine."""
    if rest.get("weights") not in ENGINE_WEIGHTS:
        raise InputError(f"weights must be one of {', '.join(ENGINE_WEIGHTS)}, got {rest.get('weights')!r}")
    if info.backend == TENSORRT_LLM and rest["weights"] != "checkpoint":
        raise InputError("weights applies to the embedded engine only; a TensorRT engine holds what it was built with")
    engine_path = rest.get("engine_path")
    if engine_path is not None and info.backend == EMBEDDED:
        raise InputError("engine_path applies to TensorRT-LLM engines only; an embedded repository refers to its "
                         "engine relative to itself, so move them together")
    if engine_path is not None and not os.path.isabs(engine_path):
        raise InputError(f"engine_path {engine_path!r} must be an absolute path: the TensorRT-LLM backend opens "
                         "gpt_model_path as given, so a relative one would resolve against tritonserver's working "
                         "directory")


def available_cores() -> int:
    """CPU cores this process may run on."""
    return len(allowed_cores())


def default_torch_threads(python_instances: int, engine_instances: int = 1, cores: int | None = None) -> int:
    """Torch intra-op threads for each embedded-engine instance: the cores less one per two
    single-threaded Python-backend instances (pre/post/BLS, busy only between decode steps' outputs),
    shared among the engine instances; at least 1. More threads than cores makes OpenMP workers
    spin against each other and against the pre/post processes."""
    cores = cores or available_cores()
    reserve = min(-(-python_instances // 2), cores - 1)
    return max(1, (cores - reserve) // max(engine_instances, 1))


# ---------------------------------------------------------------- template filling
def _bool(v: bool) -> str:
    return "true" if v else "false"


def _pbtxt_str(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"')


def render_parameters(params: dict[str, Any]) -> str:
    """``parameters { key: .. value: { string_value: .. } }`` lines (values are strings in Triton)."""
    return "\n".join(f'parameters {{ key: "{_pbtxt_str(k)}" value: {{ string_value: "{_pbtxt_str(v)}" }} }}'
                     for k, v in params.items())


def _engine_ref(info: EngineInfo, s: RepoSettings, repo: Path | None) -> str:
    """The engine directory as the repository records it: relative to the repository root for the
    embedded engine (its model resolves it so), absolute for the C++ backend (it opens it as given):
    ``engine_path`` when the repository is served elsewhere."""
    if info.backend == EMBEDDED and repo is not None:
        return os.path.relpath(info.path, repo)
    return s.engine_path or str(info.path)


def backend_parameters(info: EngineInfo, s: RepoSettings, repo: Path | None = None,
                       tokenizer_dir: str = TOKENIZER_SUBDIR) -> dict[str, Any]:
    """The ``tensorrt_llm`` model's parameters for its backend."""
    if info.backend == EMBEDDED:
        return {"engine_dir": _engine_ref(info, s, repo), "device": s.device, "torch_num_threads": s.torch_num_threads,
                "decode_cores": s.decode_cores or "none",
                "max_input_len": s.max_input_len, "max_seq_len": s.max_seq_len,
                "exclude_input_in_output": _bool(s.exclude_input_in_output), "enable_metrics": "true",
                "metrics_interval_s": "0.5", "max_waiting_requests": s.max_queue_size,
                "stream_interval": s.stream_interval, "weights": s.weights,
                # Streamed responses never end inside a character (see trtmoe.triton.textstream).
                "tokenizer_dir": tokenizer_dir, "trust_remote_code": _bool(s.trust_remote_code)}
    return {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": _engine_ref(info, s, repo),
        "max_beam_width": s.max_beam_width,
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "exclude_input_in_output": _bool(s.exclude_input_in_output),
        "batch_scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": s.kv_cache_free_gpu_mem_fraction or 0.9,
        "enable_kv_cache_reuse": "false",
        # An engine whose step holds fewer tokens than its longest prompt only serves with chunked
        # context (build's preflight allows that only when the engine can chunk: paged context FMHA).
        "enable_chunked_context": _bool(info.max_num_tokens is not None and info.max_num_tokens < info.max_input_len),
        "normalize_log_probs": "true",
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
    }


# Inputs the embedded tensorrt_llm model also reads under tensorrtllm_backend <= v0.19.0's names. The
# C++ backend of 1.2 would ignore them silently, so its config does not declare them (a client
# sending one there gets Triton's "unexpected input" error instead).
_LEGACY_ALIAS_INPUTS = (
    '  { name: "min_length" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } optional: true },\n'
    '  { name: "random_seed" data_type: TYPE_UINT64 dims: [ 1 ] reshape: { shape: [ ] } optional: true },')


# Cancellation through the ensemble (embedded engine). Triton 2.51's ensemble scheduler never tells a
# running step that its ensemble request was cancelled; it only marks the steps it schedules later.
# So preprocessing makes a key per request, the ensemble hands it to tensorrt_llm (the id of that
# generation) and to postprocessing, and postprocessing - which runs once per streamed response and
# sees the cancellation on the next one - sends tensorrt_llm a `stop` for the key. A dynamic batcher
# drops a cancelled request before the model sees it, so a streaming postprocessing has none.
# Triton refuses a step fed from two decoupled origins, so tensorrt_llm returns the key on each
# response and postprocessing takes it from there.
_REQUEST_KEY_INPUT = '  { name: "request_key" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } optional: true },'
_REQUEST_KEY_OUTPUT = '  { name: "request_key" data_type: TYPE_STRING dims: [ 1 ] },'
_ENSEMBLE_PRE_KEY = '      output_map { key: "OUT_REQUEST_KEY" value: "_REQUEST_KEY" }'
_ENSEMBLE_LLM_KEY = ('      input_map { key: "request_key" value: "_REQUEST_KEY" }\n'
                     '      output_map { key: "request_key" value: "_LLM_REQUEST_KEY" }')
_ENSEMBLE_POST_KEY = '      input_map { key: "REQUEST_KEY" value: "_LLM_REQUEST_KEY" }'


def template_values(info: EngineInfo, s: RepoSettings, repo: Path | None = None,
                    tokenizer_dir: str = TOKENIZER_SUBDIR) -> dict[str, str]:
    """Every placeholder of the templates, as text. ``repo``: where the repository will live (paths
    are recorded relative to it)."""
    emb_dtype = _DTYPE_TO_TRITON.get(info.model.source_dtype, "TYPE_FP16")
    # Only a streaming ensemble runs postprocessing while tensorrt_llm still generates.
    stop_by_key = info.backend == EMBEDDED and s.decoupled
    return {
        "engine_dir": _engine_ref(info, s, repo),
        "legacy_alias_inputs": _LEGACY_ALIAS_INPUTS if info.backend == EMBEDDED else "",
        "request_key_input": _REQUEST_KEY_INPUT if info.backend == EMBEDDED else "",
        "request_key_output": _REQUEST_KEY_OUTPUT if info.backend == EMBEDDED else "",
        "ensemble_pre_request_key": _ENSEMBLE_PRE_KEY if stop_by_key else "",
        "ensemble_llm_request_key": _ENSEMBLE_LLM_KEY if stop_by_key else "",
        "ensemble_post_request_key": _ENSEMBLE_POST_KEY if stop_by_key else "",
        "postprocessing_batching": "" if stop_by_key else "dynamic_batching {}",
        "cancel_stop_model": "tensorrt_llm" if stop_by_key else "",
        "engine_kind": "embedded" if info.backend == EMBEDDED else "TensorRT-LLM",
        "triton_backend": "python" if info.backend == EMBEDDED else "tensorrtllm",
        "triton_max_batch_size": str(s.max_batch_size),
        "decoupled_mode": _bool(s.decoupled),
        "max_queue_delay_microseconds": str(s.max_queue_delay_microseconds),
        "max_queue_size": str(s.max_queue_size),
        "logits_datatype": info.logits_triton_dtype,
        "encoder_input_features_data_type": emb_dtype,
        "prompt_embedding_table_data_type": emb_dtype,
        "tokenizer_dir": tokenizer_dir,
        "add_special_tokens": _bool(s.add_special_tokens),
        "skip_special_tokens": _bool(s.skip_special_tokens),
        "trust_remote_code": _bool(s.trust_remote_code),
        "max_input_len": str(s.max_input_len),
        "preprocessing_instance_count": str(s.preprocessing_instance_count),
        "postprocessing_instance_count": str(s.postprocessing_instance_count),
        "bls_instance_count": str(s.bls_instance_count),
        "accumulate_tokens": _bool(s.accumulate_tokens),
        "backend_parameters": render_parameters(backend_parameters(info, s, repo, tokenizer_dir)),
    }


def fill_template(text: str, values: dict[str, str], *, where: str) -> str:
    """Substitute every ``${name}``; a placeholder without a value, or one left over, is an error."""
    try:
        out = string.Template(text).substitute(values)
    except KeyError as e:
        raise TrtmoeError(f"template placeholder ${{{e.args[0]}}} has no value", where=where) from None
    except ValueError as e:
        raise TrtmoeError(f"malformed template: {e}", where=where) from None
    if "${" in out:
        line = out[: out.index("${")].count("\n") + 1
        raise TrtmoeError(f"unresolved placeholder left at line {line}", where=where)
    return out


def parse_model_config(text: str, *, where: str):
    """Parse a config.pbtxt with Triton's own ``ModelConfig`` protobuf schema (as tritonclient ships it)."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        raise BackendUnavailable(f"checking the repository's configs needs tritonclient ({e.name} is missing)",
                                 hint="pip install 'trtmoe[serve]'") from None

    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise TrtmoeError(f"config.pbtxt does not parse as a Triton ModelConfig: {e}", where=where) from None


# ---------------------------------------------------------------- cross-model checks
def check_repository_configs(configs: dict[str, Any]) -> None:
    """Check what Triton checks only at load time: names, the ensemble's wiring and the decoupled policy.

    ``configs`` maps model name -> ``ModelConfig``. Raises TrtmoeError naming the model and tensor.
    """
    for name, cfg in configs.items():
        if cfg.name != name:
            raise TrtmoeError(f"config name {cfg.name!r} differs from its folder {name!r}", where=f"{name}/config.pbtxt")
    ens = configs.get("ensemble")
    if ens is None:
        return
    dtypes = {i.name: i.data_type for i in ens.input}
    available = set(dtypes)
    for step in ens.ensemble_scheduling.step:
        model = configs.get(step.model_name)
        if model is None:
            raise TrtmoeError(f"ensemble step uses unknown model {step.model_name!r}", where="ensemble/config.pbtxt")
        inputs = {i.name: i for i in model.input}
        outputs = {o.name: o for o in model.output}
        for key, value in step.input_map.items():
            if key not in inputs:
                raise TrtmoeError(f"input_map key {key!r} is not an input of {step.model_name}", where="ensemble/config.pbtxt")
            if value not in available:
                raise TrtmoeError(f"{step.model_name}.{key} is fed from {value!r}, which no earlier step produces",
                                  where="ensemble/config.pbtxt")
            if dtypes.get(value) is not None and dtypes[value] != inputs[key].data_type:
                raise TrtmoeError(f"{step.model_name}.{key} expects a different data type than {value!r} carries",
                                  where="ensemble/config.pbtxt")
        for key, value in step.output_map.items():
            if key not in outputs:
                raise TrtmoeError(f"output_map key {key!r} is not an output of {step.model_name}", where="ensemble/config.pbtxt")
            available.add(value)
            dtypes[value] = outputs[key].data_type
        required = {i.name for i in model.input if not i.optional}
        missing = required - set(step.input_map.keys())
        if missing:
            raise TrtmoeError(f"required inputs {sorted(missing)} of {step.model_name} are not wired",
                              where="ensemble/config.pbtxt")
    for o in ens.output:
        if o.name not in available:
            raise TrtmoeError(f"ensemble output {o.name!r} is produced by no step", where="ensemble/config.pbtxt")
    used = {o.name for o in ens.output}
    used |= {v for step in ens.ensemble_scheduling.step for v in step.input_map.values()}
    for step in ens.ensemble_scheduling.step:  # Triton refuses to load an ensemble with an unused tensor
        for value in step.output_map.values():
            if value not in used:
                raise TrtmoeError(f"ensemble tensor {value!r} from {step.model_name} is used by no step or "
                                  "output", where="ensemble/config.pbtxt")
    llm, bls = configs.get("tensorrt_llm"), configs.get("tensorrt_llm_bls")
    if llm is not None and bls is not None:
        if llm.model_transaction_policy.decoupled != bls.model_transaction_policy.decoupled:
            raise TrtmoeError("tensorrt_llm and tensorrt_llm_bls disagree on decoupled mode")
    for cfg in configs.values():
        if cfg.max_batch_size != ens.max_batch_size:
            raise TrtmoeError(f"{cfg.name} has max_batch_size {cfg.max_batch_size}, the ensemble {ens.max_batch_size}")


# ---------------------------------------------------------------- tokenizer
def find_tokenizer(info: EngineInfo) -> Path | None:
    """A tokenizer folder next to the engine or its checkpoint, if there is one."""
    roots = [info.path] + ([info.checkpoint_dir] if info.checkpoint_dir else [])
    for root in roots:
        for cand in (root / "tokenizer", root):
            if (cand / "tokenizer.json").is_file() or (cand / "tokenizer.model").is_file():
                return cand
    return None


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy a tokenizer's files (no weights, no sub-folders); returns the file names."""
    if not src.is_dir():
        raise InputError("tokenizer directory not found", where=str(src))
    dst.mkdir(parents=True)
    names = []
    tree = source_tree(src)  # a link leading out of the tokenizer's own tree is never followed
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name.endswith(_WEIGHT_SUFFIXES) or f.name.endswith(".index.json"):
            continue
        if not stays_inside(f, tree):
            continue
        if f.stat().st_size > _MAX_TOKENIZER_FILE:
            continue
        shutil.copyfile(f, dst / f.name)
        names.append(f.name)
    if not any(n in names for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")):
        raise InputError("no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, vocab.txt)", where=str(src))
    return names


TOKENIZER_FACTS = "trtmoe_tokenizer.json"  # special-token ids for the tokenizers-only pre/post models
_TOKENIZER_EXTRA = "pip install 'trtmoe[tokenizer]'"


def _special_token(cfg: dict, key: str) -> str | None:
    v = cfg.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def _read_json(p: Path) -> dict:
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _convert_with_transformers(path: Path, *, trust_remote_code: bool) -> None:
    """Write ``tokenizer.json`` for a folder that has only a SentencePiece (or vocab) tokenizer."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise BackendUnavailable("this tokenizer has no tokenizer.json; converting it needs transformers "
                                 "and sentencepiece", where=str(path), hint=_TOKENIZER_EXTRA) from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(tok).__name__} has no fast (tokenizers) form")
        backend.save(str(path / "tokenizer.json"))
    except ImportError as e:
        raise BackendUnavailable(f"converting this tokenizer to tokenizer.json needs {e.name or 'sentencepiece'}",
                                 where=str(path), hint=_TOKENIZER_EXTRA) from None
    except Exception as e:  # noqa: BLE001 - any loader failure is the user's tokenizer
        raise InputError(f"the tokenizer cannot be converted to tokenizer.json: {e}", where=str(path),
                         hint="pass --tokenizer with a Hugging Face tokenizer folder holding tokenizer.json") from None


def _match_transformers(path: Path, tok: Any, sample: str, *, trust_remote_code: bool) -> tuple[Any, list[str]]:
    """Where transformers is installed, make ``tokenizer.json`` encode as ``AutoTokenizer`` does (a
    tokenizer_config's add_bos_token/add_eos_token can override the file's post-processor)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return tok, []
    try:
        hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - tokenizer.json loaded; transformers' view is only a cross-check
        return tok, []
    want = hf.encode(sample)
    if tok.encode(sample).ids == want:
        return tok, []
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None and backend.encode(sample).ids == want:
        backend.save(str(path / "tokenizer.json"))
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / "tokenizer.json")), []
    return tok, [f"tokenizer.json encodes {sample!r} differently from transformers.AutoTokenizer; "
                 "pre/postprocessing use tokenizer.json"]


def prepare_tokenizer(path: Path, info: EngineInfo, *, trust_remote_code: bool) -> list[str]:
    """Make the copied tokenizer loadable by the ``tokenizers`` library alone, the way pre/post
    processing load it: ``tokenizer.json`` (converted when missing) and ``trtmoe_tokenizer.json``
    (eos/pad/bos ids, the special ids, the decode clean-up flag). Round-trips a text and checks that
    the vocabulary fits the engine's. Returns warnings; raises InputError / BackendUnavailable."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise BackendUnavailable("the tokenizers library is missing", hint="pip install 'trtmoe'") from None
    if not (path / "tokenizer.json").is_file():
        _convert_with_transformers(path, trust_remote_code=trust_remote_code)
    try:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - any loader failure is the user's tokenizer
        raise InputError(f"tokenizer.json does not load with the tokenizers library: {e}", where=str(path),
                         hint="pass --tokenizer with a local Hugging Face tokenizer folder") from None
    sample = "def main(): return 42"
    tok, warnings = _match_transformers(path, tok, sample, trust_remote_code=trust_remote_code)
    cfg = {**_read_json(path / "special_tokens_map.json"), **_read_json(path / "tokenizer_config.json")}
    ids = {}
    for role in ("eos", "pad", "bos", "unk"):
        name = _special_token(cfg, f"{role}_token")
        ids[role] = tok.token_to_id(name) if name else None
        if name and ids[role] is None:
            warnings.append(f"{role}_token {name!r} is not in the tokenizer's vocabulary")
    special = sorted({i for i, t in tok.get_added_tokens_decoder().items() if t.special}
                     | {i for i in ids.values() if i is not None})
    facts = {"eos_token_id": ids["eos"], "pad_token_id": ids["pad"], "bos_token_id": ids["bos"],
             "unk_token_id": ids["unk"], "special_ids": special,
             "clean_up_tokenization_spaces": bool(cfg.get("clean_up_tokenization_spaces", False))}
    (path / TOKENIZER_FACTS).write_text(json.dumps(facts, indent=2) + "\n")
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > info.model.vocab_size:
        raise InputError(f"the tokenizer has {size} tokens but the engine's vocab_size is {info.model.vocab_size}",
                         where=str(path), hint="this tokenizer belongs to a different model")
    text = tok.decode(tok.encode(sample, add_special_tokens=False).ids)
    if text.strip() != sample:
        warnings.append(f"tokenizer round trip changed {sample!r} into {text!r}")
    if ids["eos"] is None:
        warnings.append("the tokenizer has no eos token; generation stops only at max_tokens unless end_id is sent")
    return warnings


def _write_model(src: Path, dst: Path, model: str, values: dict[str, str], info: EngineInfo):
    """One model's folder from its template ``src``: the filled config.pbtxt (returned parsed) and
    its Python files."""
    text = fill_template((src / "config.pbtxt").read_text(), values, where=str(src / "config.pbtxt"))
    config = parse_model_config(text, where=f"{model}/config.pbtxt")
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.pbtxt").write_text(text)
    (dst / "1").mkdir(exist_ok=True)
    model_py = src / "1" / "model.py"
    # The C++ backend serves a TensorRT engine; the Python model is for the embedded one only.
    if model_py.is_file() and not (model == "tensorrt_llm" and info.backend == TENSORRT_LLM):
        shutil.copyfile(model_py, dst / "1" / "model.py")
    if model in CANCEL_SENDERS:  # they import no trtmoe: the sender's module goes beside them
        shutil.copyfile(cancel_channel.__file__, dst / "1" / CANCEL_MODULE)
    return config


def _file_hashes(root: Path, tok_sub: str) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path; a file outside the tokenizer folder with an
    unfilled ``${...}`` placeholder raises."""
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            # Tokenizer files are data (a vocabulary may hold "${"); everything else must be filled.
            if not rel.startswith(tok_sub + "/") and "${" in p.read_text(errors="replace"):
                raise TrtmoeError("unresolved ${...} placeholder left", where=rel)
            files[rel] = sha256_file(p)
    return files


def _llmapi_settings(info: EngineInfo, req: RepositorySettings) -> RepositorySettings:
    """Check ``req`` against the llmapi layout and fill in its thread default."""
    if info.backend != EMBEDDED:
        raise InputError("the llmapi layout serves the embedded engine; a TensorRT-LLM engine is served by the "
                         "default layout (the tensorrtllm backend behind the ensemble)", where=str(info.path))
    sch = req.scheduling
    unused = [name for name, value, default in (
        ("preprocessing_instance_count", req.instances.preprocessing_instance_count, 1),
        ("postprocessing_instance_count", req.instances.postprocessing_instance_count, 1),
        ("bls_instance_count", req.instances.bls_instance_count, 1),
        ("exclude_input_in_output", sch.exclude_input_in_output, False),
        ("max_queue_delay_microseconds", sch.max_queue_delay_microseconds, 0)) if value != default]
    if unused:
        raise InputError(f"{', '.join(unused)} do(es) not apply to the llmapi layout: it has no pre/post/BLS "
                         "models, no dynamic batcher, and its text_output never holds the prompt",
                         hint="drop them, or use the default layout")
    pl = req.placement
    if not pl.torch_num_threads and not isinstance(parse_cores(pl.decode_cores), list):
        # No pre/post/BLS processes; tritonserver's own threads still carry every response (one
        # core's worth kept for them, as for two Python instances).
        return replace(req, placement=replace(pl, torch_num_threads=default_torch_threads(2)))
    return req


# ---------------------------------------------------------------- the generator
def generate_repository(engine_dir: str | Path, out_dir: str | Path, settings: RepositorySettings | None = None, *,
                        force: bool = False, **options: Any) -> RepositoryResult:
    """Write a Triton model repository for ``engine_dir`` at ``out_dir`` as ``settings`` asks (default:
    every default); ``options``, flat setting names (``RepositorySettings.with_options``), replace
    single settings of it. ``force`` replaces an existing ``out_dir``.

    ``tokenizer_dir`` defaults to a tokenizer found beside the engine or its checkpoint. Limits
    (``max_batch_size``, ``max_input_len``, ``max_seq_len``: requests/tokens) default to the engine's
    build_config and may not exceed it; ``max_beam_width`` and ``world_size`` must equal it.
    ``streaming`` makes tensorrt_llm/BLS (and so the ensemble) decoupled (upstream's default is not);
    ``exclude_input_in_output`` sets the default for requests that do not send it (upstream: false).
    ``torch_num_threads`` 0: chosen from the cores (see ``default_torch_threads``); with a ``decode_cores``
    list, one per core. ``decode_cores`` (embedded engine): "auto", "none" or a core list for the decode
    thread (see ``trtmoe.triton.cpu_binding``). ``stream_interval``
    (embedded engine): a streamed response every that many tokens; None/0 = auto (every token
    up to 4 active streams, then ceil(active / 4)). ``engine_path`` (TensorRT-LLM engines): the absolute
    path the engine will have where the repository is served (default: its path here).

    ``layout`` "llmapi" (embedded engines): one ``tensorrt_llm`` model with the inputs and outputs of
    TensorRT-LLM 1.2's llmapi model (text in, text out, tokenizer in the same process; not batched,
    decoupled with ``streaming``) instead of the ensemble and its four models. Raises InputError.
    """
    req = settings or RepositorySettings()
    if options:
        req = req.with_options(**options)
    layout = req.layout
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if req.tokenizer.trust_remote_code:
        raise InputError("--trust-remote-code is refused: trtmoe never runs code from a tokenizer or model folder",
                         hint="use a tokenizer folder with tokenizer.json (or a SentencePiece model that "
                              "transformers converts without remote code)")
    info = read_engine_dir(engine_dir)
    if manifest_file(info.path) is not None:
        try:  # its entries must be plain paths inside the engine directory (no '..', no absolute path)
            read_manifest(info.path)
        except TrtmoeError as e:
            raise InputError(f"the engine's manifest is not valid: {e.what}", where=e.where) from None
    llmapi = layout == "llmapi"
    if llmapi:
        req = _llmapi_settings(info, req)
    resolved = resolve_settings(info, req)
    tokenizer_dir = req.tokenizer.tokenizer_dir
    tok_src = Path(tokenizer_dir).expanduser().resolve() if tokenizer_dir else find_tokenizer(info)
    if tok_src is None:
        raise InputError("no tokenizer found beside the engine or its checkpoint", where=str(info.path),
                         hint="pass --tokenizer DIR (a Hugging Face tokenizer folder)")
    tpl = Path(req.templates) if req.templates else templates_dir()
    models, tok_sub, contract = (LLMAPI_MODELS, LLMAPI_TOKENIZER_SUBDIR, LLMAPI_CONTRACT) if llmapi else (
        MODELS, TOKENIZER_SUBDIR, TRTLLM_CONTRACT)
    if llmapi:
        tpl = tpl / "llmapi"
    out = Path(out_dir).expanduser().absolute()
    values = template_values(info, resolved, out, tok_sub)
    warnings: list[str] = []
    configs = {}
    with atomic_directory(out, force=force, inputs=(info.path, tok_src), outside=(info.path,)) as tmp:
        copy_tokenizer(tok_src, tmp / tok_sub)
        warnings += prepare_tokenizer(tmp / tok_sub, info, trust_remote_code=False)
        for model in models:
            configs[model] = _write_model(tpl / model, tmp / model, model, values, info)
        check_repository_configs(configs)
        files = _file_hashes(tmp, tok_sub)
        engine = info.to_json()
        for key in ("path", "checkpoint_dir"):  # no absolute paths: the repository may move with its engine
            if engine.get(key):
                engine[key] = os.path.relpath(engine[key], out)
        # The artifact manifest every trtmoe output has (`trtmoe verify` rechecks its hashes).
        write_manifest(tmp, kind="triton-repository", file_hashes=files, name=MANIFEST, contract=contract,
                       engine=engine, layout=layout,
                       settings=asdict(resolved), launch_world_size=info.launch_world_size, models=list(models),
                       tokenizer_source=os.path.relpath(tok_src, out), warnings=warnings)
    return RepositoryResult(path=out, engine=info, settings=resolved, models=list(models),
                            tokenizer_dir=out / tok_sub, launch_world_size=info.launch_world_size,
                            files=files, warnings=warnings, layout=layout)


def validate_repository(repo: str | Path) -> dict[str, Any]:
    """Parse every ``*/config.pbtxt`` of an existing repository and run the cross-model checks.

    Returns {model name: ModelConfig}; raises TrtmoeError on a leftover ``${`` or a bad config.
    """
    root = Path(repo)
    if not root.is_dir():
        raise InputError("model repository not found", where=str(root))
    configs = {}
    for cfg in sorted(root.glob("*/config.pbtxt")):
        text = cfg.read_text()
        if "${" in text:
            line = text[: text.index("${")].count("\n") + 1
            raise TrtmoeError(f"unresolved placeholder at line {line}", where=str(cfg))
        configs[cfg.parent.name] = parse_model_config(text, where=str(cfg))
    if not configs:
        raise InputError("no */config.pbtxt here; not a Triton model repository", where=str(root))
    check_repository_configs(configs)
    return configs
