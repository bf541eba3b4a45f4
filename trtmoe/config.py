"""YAML build configs, validated strictly, merged CLI > YAML > defaults.

A config has up to seven sections (``model``, ``convert``, ``quantize``, ``build``, ``repo``, ``serve``,
``calibrate``): every stage's options, so one file drives ``calibrate``, ``convert``, ``build``, ``repo``
and ``serve`` and the command line overrides any of them. An unknown section or key, or a bad value, is a ConfigError
naming the key and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import yaml

from . import DEFAULT_TRTLLM_VERSION
from .errors import ConfigError
from .quant import ENGINE_PATH_NAMES, FLOAT_NAMES, QUANTIZED_NAMES, ROUNDING_NAMES


@dataclass(frozen=True)
class Key:
    type: type | tuple[type, ...]
    default: Any = None
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False
    help: str = ""
    # The command-line spelling: "--name" (the default is the key with dashes), "--on/--off" for a
    # bool, several spellings separated by spaces.
    flag: str | None = None
    shown_default: str | None = None  # the help's "[default: …]" where the bare default would mislead
    metavar: str | None = None  # the help's name for the value (DIR, LIST)


_POS = dict(minimum=1)
# Engine limits: TensorRT-LLM's build config and Triton's model config hold them as 32-bit integers.
INT32_MAX = 2 ** 31 - 1
_LIMIT = dict(minimum=1, maximum=INT32_MAX)
SCHEMA: dict[str, dict[str, Key]] = {
    "convert": {
        "tp": Key(int, 1, help="Tensor-parallel size.", **_POS),
        "pp": Key(int, 1, help="Pipeline-parallel size.", **_POS),
        "moe_tp": Key(int, None, nullable=True, help="MoE tensor-parallel size (moe_tp × moe_ep = tp).", **_POS),
        "moe_ep": Key(int, None, nullable=True, help="MoE expert-parallel size.", **_POS),
        "dtype": Key(str, "auto", choices=("auto", "float32", "float16", "bfloat16"),
                     help="Weight dtype; auto keeps the source dtype."),
        "trtllm_version": Key(str, DEFAULT_TRTLLM_VERSION, choices=("1.2", "1.2.0", "1.2.1"),
                              help="Target TensorRT-LLM release line."),
        "device": Key(str, "auto", choices=("auto", "cpu", "cuda"),
                      help="Where the embedded and tensorrt-llm targets' INT4 searches (awq scale and clip, gptq "
                           "codes) run: cpu, cuda (an error when no CUDA device is present), or auto (cuda when "
                           "one is)."),
    },
    "quantize": {
        # Same names as trtmoe.quant.policies.POLICIES.
        "policy": Key(str, "none", choices=("none", "graded", "uniform", "frequency", "frequency-bytes",
                                            "random-bytes"),
                      help="Expert quantization policy.", shown_default="graded when a budget is given, else none"),
        "format": Key(str, None, nullable=True, choices=QUANTIZED_NAMES, help="Format for --policy uniform."),
        "budget_bpw": Key((int, float), None, nullable=True, minimum=1, maximum=32, flag="--budget",
                          help="Average bits per routed-expert weight, scales counted (e.g. 4.5)."),
        "budget_gb": Key((int, float), None, nullable=True, minimum=0, help="Routed-expert bytes per GPU, in GB."),
        "granularity": Key(str, "auto", choices=("auto", "matrix", "expert", "layer"),
                           help="Format unit: matrix (each expert's fc and proj apart), expert, or layer.",
                           shown_default="auto = matrix for the embedded target's budgeted policies, layer for "
                                         "tensorrt-llm"),
        "formats": Key(list, None, nullable=True,
                       choices=(*FLOAT_NAMES, *QUANTIZED_NAMES),
                       help="Candidate formats, comma separated (YAML: a list), e.g. fp16,int8,int4_g64,int4_g128.",
                       metavar="LIST",
                       shown_default="fp16 and every format measured in calibration"),
        "calib": Key(str, None, nullable=True, metavar="DIR",
                     help="Calibration directory from `trtmoe calibrate` (needed by graded/frequency/balanced)."),
        "placement": Key(str, "identity", choices=("identity", "balanced"),
                         help="balanced: permute experts per layer to even out measured load across EP ranks."),
        "rounding": Key(str, None, nullable=True, choices=ROUNDING_NAMES,
                        shown_default="the calibration's rounding; awq without a calibration",
                        help="INT4 rounding (W4A8-AWQ's INT4 included): awq (activation-aware scale and clip "
                             "search on the calibration's "
                             "routed tokens; round to nearest without them), rtn (round to nearest), gptq "
                             "(error-feedback codes from the routed tokens' input Gram matrix) or awq_gptq "
                             "(both). FP8 / FP8-block / NVFP4 / MXFP4 experts: gptq error feedback, awq a "
                             "per-block scale search, awq_gptq both (unified-HF targets too)."),
        "seed": Key(int, 0, help="Seed of the random-bytes policy."),
    },
    "build": {
        "backend": Key(str, "embedded", choices=("embedded", "tensorrt-llm"),
                       help="tensorrt-llm: run trtllm-build (GPU + TensorRT-LLM 1.2.x); embedded: engine dir for "
                            "the embedded PyTorch engine."),
        "max_batch_size": Key(int, 8, help="Requests decoded together.", **_LIMIT),
        "max_input_len": Key(int, None, nullable=True, help="Longest prompt, tokens.",
                             shown_default="1024, or half of max_seq_len when that is smaller", **_LIMIT),
        "max_seq_len": Key(int, None, nullable=True, help="Longest prompt + output, tokens.",
                           shown_default="the model's max_position_embeddings", **_LIMIT),
        "max_num_tokens": Key(int, 8192, help="Tokens per engine step.", **_LIMIT),
        "max_beam_width": Key(int, 1, minimum=1, maximum=8,
                              help="Widest beam search a request may ask for (beam_width); 1 = no beam search."),
        "tokens_per_block": Key(int, 32, choices=(8, 16, 32, 64, 128), help="Tokens per paged KV block."),
        "kv_cache_type": Key(str, "paged", choices=("paged", "continuous"), help="KV cache kind for TensorRT-LLM."),
        "gemm_plugin": Key(str, "auto", choices=("auto", "float16", "bfloat16", "float32", "disable")),
        "gpt_attention_plugin": Key(str, "auto", choices=("auto", "float16", "bfloat16", "float32")),
        "moe_plugin": Key(str, "auto", choices=("auto", "float16", "bfloat16", "float32")),
        "context_fmha": Key(bool, True, help="Fused attention in the context phase."),
        "use_paged_context_fmha": Key(bool, True, help="Paged context FMHA (KV reuse, chunked context)."),
        "remove_input_padding": Key(bool, True, help="Packed (unpadded) inputs."),
        "workers": Key(int, 1, help="Ranks trtllm-build builds in parallel.", **_POS),
        "device": Key(str, "auto", choices=("auto", "cpu", "cuda"), help="Device recorded for the embedded engine."),
        "cpu_matmul": Key(str, "auto", choices=("auto", "blas"),
                          help="The embedded engine's CPU matrix products: auto (MKL, oneDNN for products of 8M "
                               "multiply-adds and more, routed expert matrices of 2^18 elements and more "
                               "held packed for oneDNN, INT8 / INT4 experts of a 16-bit model in PyTorch's "
                               "weight-only integer kernels) or blas (MKL only; quantized experts rebuilt "
                               "in float32 on every call)."),
        "cpu_activations": Key(str, "float32", choices=("float32", "model"),
                               help="The embedded engine's activations and KV cache on CPU: float32 (exact, "
                                    "the executable spec) or model (the checkpoint's dtype, as on CUDA: with a "
                                    "bfloat16 checkpoint on a CPU with AVX512-BF16 or AMX, every weight is held "
                                    "in bfloat16 packed for oneDNN, half float32's memory and about 1.8x its decode "
                                    "speed at real widths)."),
        "gather_context_logits": Key(bool, False, help="Requests may ask for return_context_logits (the prompt's "
                                                       "logits at every position); trtllm-build's flag of that name."),
        "gather_generation_logits": Key(bool, False, help="Requests may ask for return_generation_logits (each "
                                                          "step's raw logits); trtllm-build's flag of that name."),
    },
    "repo": {  # `trtmoe repo`: the Triton model repository (limits are checked against the engine's)
        "tokenizer": Key(str, None, nullable=True, metavar="DIR", help="Hugging Face tokenizer folder.",
                         shown_default="the one beside the engine or its checkpoint"),
        "max_batch_size": Key(int, None, nullable=True, help="Triton max_batch_size (<= the engine's).",
                              shown_default="the engine's", **_LIMIT),
        "max_beam_width": Key(int, None, nullable=True, help="Must equal the engine's build value.",
                              shown_default="the engine's", **_LIMIT),
        "max_input_len": Key(int, None, nullable=True, help="Prompt limit in tokens (<= the engine's).",
                             shown_default="the engine's", **_LIMIT),
        "max_seq_len": Key(int, None, nullable=True, help="Prompt + output limit in tokens (<= the engine's).",
                           shown_default="the engine's", **_LIMIT),
        "world_size": Key(int, None, nullable=True, help="Checked against the engine's tp × pp.",
                          shown_default="the engine's", **_LIMIT),
        "layout": Key(str, "inflight", choices=("inflight", "llmapi"),
                      help="inflight: upstream's inflight_batcher_llm models (ensemble, pre/postprocessing, "
                           "tensorrt_llm, tensorrt_llm_bls; token ids between them). llmapi (embedded engine): "
                           "one tensorrt_llm model with the inputs and outputs of TensorRT-LLM 1.2's llmapi "
                           "model, text in and text out (text_input, sampling_param_*, text_output), the "
                           "tokenizer in the same process: a streamed token crosses no ensemble step."),
        "streaming": Key(bool, False, flag="--streaming/--no-streaming --decoupled/--not-decoupled",
                         help="Decoupled tensorrt_llm/BLS (and so ensemble): tokens stream over gRPC streams / "
                              "generate_stream, and unary ModelInfer is refused.",
                         shown_default="not decoupled, as upstream's templates"),
        "exclude_input_in_output": Key(bool, False, flag="--exclude-input/--include-input",
                                       help="Default for requests that do not send exclude_input_in_output: leave "
                                            "the prompt out of non-streamed outputs.",
                                       shown_default="include it, as upstream"),
        "max_queue_delay_microseconds": Key(int, 0, minimum=0, flag="--max-queue-delay-us",
                                            help="Dynamic batching delay, microseconds."),
        "max_queue_size": Key(int, 0, minimum=0, help="Requests queued per model; 0 = unbounded."),
        "preprocessing_instance_count": Key(int, 1, flag="--preprocessing-instances",
                                            help="Tokenizing model instances.", **_POS),
        "postprocessing_instance_count": Key(int, 1, flag="--postprocessing-instances",
                                             help="Detokenizing model instances.", **_POS),
        "bls_instance_count": Key(int, 1, flag="--bls-instances", help="tensorrt_llm_bls model instances.", **_POS),
        "kv_cache_free_gpu_mem_fraction": Key((int, float), None, nullable=True, minimum=0, maximum=1,
                                              help="TensorRT engines only.", shown_default="0.9"),
        "device": Key(str, None, nullable=True, help="Embedded engine device: auto, cpu, cuda, cuda:N.",
                      shown_default="auto"),
        "torch_num_threads": Key(int, 0, minimum=0, flag="--torch-threads",
                                 help="Embedded engine torch intra-op threads; 0 = this machine's cores less one "
                                      "per two pre/post/BLS instances (at least 1). Written to config.pbtxt; "
                                      "capped at the serving machine's cores."),
        "decode_cores": Key((str, int), None, nullable=True, metavar="auto|none|LIST",
                            help="Embedded engine: keep its decode thread on cores of its own (auto: the last "
                                 "--torch-threads cores; or a list such as 2-7) and every other thread of the "
                                 "server on the rest, so that no frontend, sender or client thread takes the "
                                 "decode core for a scheduler slice between two tokens. `trtmoe serve` starts "
                                 "tritonserver on the rest; on a machine that cannot meet it, serving goes on "
                                 "unbound with a warning in the log.", shown_default="none"),
        "weights": Key(str, "checkpoint", choices=("checkpoint", "compute"),
                       help="Embedded engine: hold the weight matrices in the checkpoint's dtype (its memory; each "
                            "product converts a block of the weight at a time) or in the compute dtype (float32 on "
                            "CPU, packed for oneDNN: faster, up to 2-3x a 16-bit checkpoint's memory)."),
        "stream_interval": Key(int, None, nullable=True, minimum=0,
                               help="Embedded engine: a streamed response every N tokens (the first and last at "
                                    "once). 1 = every token; 0 = auto: every token up to 4 active streams, then "
                                    "ceil(active/4), which keeps per-response overhead bounded when many streams "
                                    "share the CPU.", shown_default="auto"),
        "trust_remote_code": Key(bool, False, help="Refused when set: trtmoe never runs code from a tokenizer or "
                                                   "model folder (false is accepted, so configs that state it load)."),
        "engine_path": Key(str, None, nullable=True, metavar="PATH",
                           help="TensorRT-LLM engines: the engine directory's absolute path on the serving "
                                "machine (gpt_model_path), for a repository deployed where ENGINE_DIR is not; "
                                "the backend opens it as given. An embedded repository refers to its engine "
                                "relative to itself and takes none.",
                           shown_default="ENGINE_DIR's absolute path"),
    },
    "serve": {  # `trtmoe serve`: the tritonserver process
        "host": Key(str, "127.0.0.1", help="Address to bind (0.0.0.0 exposes the server)."),
        "http_port": Key(int, 8000, minimum=0, maximum=65535, help="0 picks a free port."),
        "grpc_port": Key(int, 8001, minimum=0, maximum=65535, help="0 picks a free port."),
        "metrics_port": Key(int, 8002, minimum=0, maximum=65535, help="0 picks a free port."),
        "world_size": Key(int, None, nullable=True, help="MPI ranks.", shown_default="from the repository manifest",
                          **_POS),
        "server": Key(str, None, nullable=True, choices=("system", "pytriton"), help="tritonserver to use.",
                      shown_default="the one on PATH (NGC container), else nvidia-pytriton's"),
        "timeout_s": Key((int, float), 300.0, minimum=1, flag="--timeout", help="Seconds to wait for ready."),
        "log_verbose": Key(int, 0, minimum=0, help="tritonserver's --log-verbose level."),
        "restart": Key(int, 3, minimum=0, help="When a backend process dies or tritonserver exits, start it again "
                                               "on the same repository and ports, at once up to this many times "
                                               "within --restart-window, then after a back-off (--restart-backoff) "
                                               "(0: exit 1 at the first failure)."),
        "restart_window_s": Key((int, float), 3600, minimum=0, flag="--restart-window", metavar="SECONDS",
                                help="Only restarts made within the last this many seconds count against "
                                     "--restart, so a server that dies now and then is always restarted and "
                                     "one that keeps dying is restarted only after a back-off (0: count over "
                                     "the whole run)."),
        "http_max_body_mb": Key((int, float), 3, minimum=0, flag="--http-max-body-mb", metavar="MB",
                                help="Answer HTTP requests whose body is over this many MiB with 413 before "
                                     "tritonserver reads them (an upstream report has 2.51 crash on one of 4 MB); "
                                     "the HTTP port is then a small front passing everything else through (0: no "
                                     "front)."),
        "restart_backoff_s": Key((int, float), 60, minimum=0, flag="--restart-backoff", metavar="SECONDS",
                                 help="Once --restart is spent within the window, each further restart waits 1, 2, "
                                      "4 ... seconds, at most this many, instead of ending the service, so that "
                                      "requests which crash tritonserver cannot switch it off (0: exit 1 instead, "
                                      "for a supervisor to take over)."),
    },
    "calibrate": {  # `trtmoe calibrate`: routing statistics and sensitivity on calibration text
        "data": Key(str, None, nullable=True, metavar="PATH",
                    help="Calibration text: a file, a directory of text files, or JSONL with a text field."),
        "samples": Key(int, 32, help="Number of token windows.", **_POS),
        "seq_len": Key(int, 128, minimum=2, help="Tokens per window."),
        "formats": Key(list, None, nullable=True, choices=QUANTIZED_NAMES, metavar="LIST",
                       help="Candidate formats to measure, comma separated (YAML: a list); formats that cannot "
                            "store the model's matrices are skipped with a note.",
                       shown_default=",".join(ENGINE_PATH_NAMES)),
        "min_tokens": Key(int, 16, minimum=0,
                          help="Experts routed fewer tokens than this are flagged and their ΔKL also estimated."),
        "field": Key(str, "text", help="JSONL field holding the text."),
        "tokenizer": Key(str, None, nullable=True, metavar="DIR", help="Tokenizer folder.", shown_default="MODEL"),
        "add_bos": Key(bool, None, nullable=True,
                       help="Prepend BOS to each document.",
                       shown_default="the tokenizer's add_bos_token; lacking one, BOS when the tokenizer names one"),
        "rounding": Key(str, "awq_gptq", choices=ROUNDING_NAMES,
                        help="How INT4 formats (W4A8-AWQ included) are rounded when their ΔKL is measured "
                             "(convert with the same): "
                             "awq_gptq searches awq's activation-aware scale and clip, then chooses the codes "
                             "by error feedback over each matrix's routed-token input Gram matrix; awq stops "
                             "after the search; rtn rounds to nearest; gptq is error feedback alone. FP8 / "
                             "FP8-block / NVFP4 / MXFP4: error feedback (gptq), block-scale search (awq), or both."),
        "cross_fit": Key(bool, True,
                         help="Under awq, gptq or awq_gptq (fisher): score each candidate whose rounding is fitted "
                              "to the calibration rows on the sequences it was not fitted to (two folds of "
                              "alternate sequences, the codes and block-scale searches refitted on each), so a "
                              "plan's predicted ΔKL is near what held-out text measures (about 1.8x the "
                              "calibration's CPU time on the trained Mixtral fixture). --no-cross-fit scores on the "
                              "rows each rounding was fitted to: faster, and optimistic for the INT4 and FP4 formats."),
        "sensitivity": Key(str, "fisher", choices=("fisher", "exact"),
                           help="fisher: second-order estimate from one forward and one backward pass, whatever "
                                "the number of experts (resumable: rerun the same command after an interruption); "
                                "exact: end-to-end ΔKL per expert matrix and format (about formats × experts × "
                                "layers passes)."),
        "device": Key(str, "cpu", choices=("cpu", "cuda"), help="Where calibration runs."),
        "runner": Key(str, "auto", choices=("auto", "engine", "stream"),
                      help="engine: the whole model in the embedded engine (converted to a scratch checkpoint); "
                           "stream: transformers' own modelling code one decoder layer at a time, weights read "
                           "from the safetensors shards (any transformers MoE; memory independent of depth, "
                           "stated and checked before the run; fisher only); auto: the engine for the "
                           "architectures it implements, the stream for the others."),
        "target": Key(str, "embedded", choices=("embedded", "tensorrt-llm"),
                      help="tensorrt-llm also scores the group-wise int4 formats as TensorRT-LLM's stacked MoE "
                           "layout writes them (under awq / awq_gptq: one pre-quant scale per MoE layer and "
                           "matrix kind), which `convert --target tensorrt-llm` then plans on (fisher only; "
                           "more scoring and searching: the Fisher model work counted in multiply-accumulates "
                           "grows from 5.1 to 6.3 forward passes on the trained Mixtral fixture, searches "
                           "not counted; calib.cost.json has the measured seconds)."),
        # Defaults equal trtmoe.quant.awq.MAX_GRAM_IN / MAX_INPUT_TOKENS (a test keeps them so; this
        # module stays free of torch).
        "max_gram_in": Key(int, 0, minimum=0, metavar="N",
                           help="Under --rounding gptq or awq_gptq: also store the input Gram matrix over every "
                                "routed token (N² floats per expert matrix) of matrices with at most N inputs; "
                                "the others' is rebuilt when used from the stored MoE inputs (the same codes "
                                "unless calibration has more tokens than --max-input-tokens). 0 stores none."),
        "max_input_tokens": Key(int, 32768, minimum=1, metavar="N",
                                help="Under awq, gptq or awq_gptq: at most this many evenly spaced tokens per MoE "
                                     "layer are stored as its MoE inputs (hidden size × activation bytes each), "
                                     "which every expert matrix's activation statistics are rebuilt from."),
    },
}
TOP_LEVEL = {"model": Key(str, None, nullable=True, help="HF model directory or hub id")}


def _type_name(t) -> str:
    if isinstance(t, tuple):
        return " or ".join(x.__name__ for x in t)
    return t.__name__


def check_value(where: str, key: Key, value: Any) -> Any:
    if value is None:
        if key.nullable or key.default is None:
            return None
        raise ConfigError(f"{where} must not be null")
    if key.type is float or (isinstance(key.type, tuple) and float in key.type):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif key.type is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, key.type)
    if not ok:
        raise ConfigError(f"{where} must be {_type_name(key.type)}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every bound below
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    if key.choices is not None and isinstance(value, list):
        bad = [v for v in value if v not in key.choices]
        if bad:
            raise ConfigError(f"{where} has {', '.join(map(repr, bad))}, not allowed",
                              hint="allowed items: " + ", ".join(map(str, key.choices)))
    elif key.choices is not None and value not in key.choices:
        raise ConfigError(f"{where} = {value!r} is not allowed", hint="allowed: " + ", ".join(map(str, key.choices)))
    if key.minimum is not None and value < key.minimum:
        raise ConfigError(f"{where} = {value!r} is below the minimum {key.minimum}")
    if key.maximum is not None and value > key.maximum:
        raise ConfigError(f"{where} = {value!r} is above the maximum {key.maximum}")
    return value


def defaults() -> dict:
    out = {s: {k: key.default for k, key in keys.items()} for s, keys in SCHEMA.items()}
    out["model"] = None
    return out


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error as one phrase with its position (PyYAML's own text spans several lines)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    what = getattr(e, "problem", None) or getattr(e, "context", None) or type(e).__name__
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{' '.join(str(what).split())}{where}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (the plain loader keeps the last
    one silently): a config must not say two things."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: the base class says so
                    break
                if first is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {first.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping)


def load_yaml(path: str | Path | None) -> dict:
    """Read and validate a YAML build config; returns only the keys it sets."""
    if path is None:
        return {}
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError("config file not found", where=str(p)) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a YAML file", where=str(p)) from None
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror}", where=str(p)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text (byte {e.start}, line {line})", where=str(p)) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {_yaml_problem(e)}", where=str(p)) from None
    except RecursionError:
        raise ConfigError("not valid YAML: nested too deeply", where=str(p)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("top level must be a mapping", where=str(p))
    out: dict = {}
    for sec, body in data.items():
        if sec in TOP_LEVEL:
            out[sec] = check_value(f"{p}: {sec}", TOP_LEVEL[sec], body)
            continue
        if sec not in SCHEMA:
            raise ConfigError(f"unknown section {sec!r}", where=str(p),
                              hint="allowed: " + ", ".join([*TOP_LEVEL, *SCHEMA]))
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"section {sec!r} must be a mapping", where=str(p))
        for k, v in body.items():
            if k not in SCHEMA[sec]:
                raise ConfigError(f"unknown key {sec}.{k}", where=str(p),
                                  hint=f"allowed in {sec}: " + ", ".join(SCHEMA[sec]))
            out.setdefault(sec, {})[k] = check_value(f"{p}: {sec}.{k}", SCHEMA[sec][k], v)
    return out


def resolve(yaml_path: str | Path | None = None, cli: dict | None = None) -> dict:
    """Merge CLI > YAML > defaults. ``cli`` is ``{section: {key: value}}``; None values mean 'not given'."""
    cfg = defaults()
    for src in (load_yaml(yaml_path), cli or {}):
        for sec, body in src.items():
            if sec in TOP_LEVEL:
                if body is not None:
                    cfg[sec] = body
                continue
            for k, v in (body or {}).items():
                if v is not None:
                    cfg[sec][k] = check_value(f"--{k.replace('_', '-')}", SCHEMA[sec][k], v)
    return cfg


# ---- the command line -------------------------------------------------------------------------------
# Each option a stage takes on the command line is the schema key above, so its name, type, choices,
# bounds and help are written once; the command merges what was given with `resolve`.

def _shown_default(key: Key) -> str | None:
    if key.shown_default is not None:
        return key.shown_default
    if key.default is None:
        return None
    if isinstance(key.default, bool):
        return "yes" if key.default else "no"
    return str(key.default)


def _split_list(ctx, param, value):
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def click_option(section: str, name: str):
    """A click option for schema key ``section.name``; its value is None when not given, so that
    ``resolve`` lets YAML and the defaults speak."""
    key = SCHEMA[section][name]
    spelling = key.flag or "--" + name.replace("_", "-")
    decls = spelling.split()
    kw: dict[str, Any] = {"default": None}
    if key.type is bool:
        decls = [d if "/" in d else f"{d}/--no-{d[2:]}" for d in decls]
    elif key.choices is not None and key.type is str:
        kw["type"] = click.Choice(key.choices)
    elif key.choices is not None and key.type is int:  # checked by `resolve`, named as the schema names it
        kw["type"], kw["metavar"] = int, "[" + "|".join(map(str, key.choices)) + "]"
    elif key.type is list:
        kw["callback"] = _split_list
    elif key.type is int:
        kw["type"] = int
    elif key.type is float or (isinstance(key.type, tuple) and float in key.type):
        kw["type"] = float
    if key.metavar:
        kw["metavar"] = key.metavar
    shown = _shown_default(key)
    kw["help"] = " ".join(filter(None, [key.help, f"[default: {shown}]" if shown else None]))
    return click.option(*decls, name, **kw)


def click_options(section: str, *names: str, skip: tuple[str, ...] = ()):
    """Decorator adding the options of ``names`` (every key of ``section`` when none are named, less
    ``skip``), in schema order."""
    chosen = names or tuple(k for k in SCHEMA[section] if k not in skip)

    def deco(f):
        for name in reversed(chosen):
            f = click_option(section, name)(f)
        return f

    return deco


def from_cli(options: dict, *sections: str) -> dict:
    """Sort a command's keyword options into ``{section: {key: value}}`` for ``resolve``; a key
    belongs to the first named section that has it."""
    out: dict = {s: {} for s in sections}
    for k, v in options.items():
        for s in sections:
            if k in SCHEMA[s]:
                out[s][k] = v
                break
    return out
