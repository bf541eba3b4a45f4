"""gRPC client for a generated repository's ``ensemble`` / ``tensorrt_llm_bls``, or the ``tensorrt_llm``
model of an llmapi repository (tritonclient.grpc).

Works with either kind of repository: the default one (not decoupled, as upstream's templates) is
called with unary ``ModelInfer``; a ``trtmoe repo --streaming`` one (decoupled) through the stream.
``text_output`` is read as upstream's clients read it (the first string of the 1-D array).

Decoupled models are called through the bi-directional stream (``ModelStreamInfer``) - the only gRPC
call Triton allows for them, for streamed and non-streamed requests alike - and text is handed to
``on_text`` as each response arrives. Other models are called with unary ``ModelInfer``. A call that
does not fit the model (unary to a decoupled model, streaming from a non-decoupled one) is refused
before anything is sent, with the reason and what to do instead.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import BackendUnavailable, InputError, TrtmoeError


@dataclass
class GenerateResult:
    """Text and timing of one generation. Times are seconds since the request was sent."""

    text: str
    pieces: list[str] = field(default_factory=list)
    response_times: list[float] = field(default_factory=list)
    total_s: float = 0.0
    streamed: bool = False
    model: str = "ensemble"
    outputs: dict[str, Any] = field(default_factory=dict)  # other outputs of the last response
    output_token_counts: list[int] = field(default_factory=list)  # num_output_tokens per response, if asked for
    # Beam search (beam_width > 1): every beam's text, best first, from the last response (each one
    # carries every beam so far); ``text`` is the first.
    beams: list[str] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        """Time to the first response that carried text."""
        for piece, t in zip(self.pieces, self.response_times):
            if piece:
                return t
        return None


def _client(url: str):
    try:
        import tritonclient.grpc as grpcclient
    except ImportError as e:
        raise BackendUnavailable("tritonclient[grpc] is not installed", hint="pip install 'tritonclient[grpc]'") from e
    return grpcclient.InferenceServerClient(url=url)


def _check_server(client, url: str, model: str) -> None:
    from tritonclient.utils import InferenceServerException

    try:
        live = client.is_server_live()
    except InferenceServerException as e:
        raise BackendUnavailable(f"cannot reach Triton at {url}: {e.message()}",
                                 hint="start it with `trtmoe serve REPO` or pass --url host:grpc_port") from None
    if not live:
        raise BackendUnavailable(f"Triton at {url} is not live")
    try:
        ready = client.is_model_ready(model)
    except InferenceServerException:
        ready = False
    if not ready:
        try:
            names = [m.name for m in client.get_model_repository_index().models]
        except InferenceServerException:
            names = []
        raise InputError(f"model {model!r} is not ready on {url}",
                         hint=f"available models: {', '.join(names) or 'none'}")


def is_decoupled(client, model: str, _seen: set[str] | None = None) -> bool:
    """True if ``model`` answers with a response stream: a decoupled model, or an ensemble with a
    decoupled step."""
    seen = _seen or set()
    if model in seen:
        return False
    seen.add(model)
    cfg = client.get_model_config(model, as_json=True)["config"]
    if cfg.get("model_transaction_policy", {}).get("decoupled"):
        return True
    if cfg.get("platform") == "ensemble":
        return any(is_decoupled(client, s["model_name"], seen) for s in cfg.get("ensemble_scheduling", {}).get("step", []))
    return False


_TRITON_DTYPES = {np.dtype(object): "BYTES", np.dtype(bool): "BOOL", np.dtype(np.int32): "INT32",
                  np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64", np.dtype(np.int64): "INT64"}


def _infer_inputs(arrays: dict[str, np.ndarray]) -> list:
    """tritonclient InferInputs holding ``arrays`` (name -> array), in that order."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, arr in arrays.items():
        t = grpcclient.InferInput(name, list(arr.shape), _TRITON_DTYPES[arr.dtype])
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def build_inputs(prompt: str, *, max_tokens: int, stream: bool, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop_words: list[str] | None = None, exclude_input_in_output: bool | None = None,
                 end_id: int | None = None, beam_width: int | None = None,
                 extra: dict[str, np.ndarray] | None = None) -> list:
    """The ensemble's input tensors for one prompt (batch of 1)."""
    arrays: dict[str, np.ndarray] = {
        "text_input": np.array([[prompt.encode("utf-8")]], dtype=object),
        "max_tokens": np.array([[max_tokens]], dtype=np.int32),
        "stream": np.array([[stream]], dtype=bool),
    }
    if temperature is not None:
        arrays["temperature"] = np.array([[temperature]], dtype=np.float32)
    if top_k is not None:
        arrays["top_k"] = np.array([[top_k]], dtype=np.int32)
    if top_p is not None:
        arrays["top_p"] = np.array([[top_p]], dtype=np.float32)
    if seed is not None:
        arrays["seed"] = np.array([[seed]], dtype=np.uint64)
    if stop_words:
        arrays["stop_words"] = np.array([[w.encode("utf-8") for w in stop_words]], dtype=object)
    if exclude_input_in_output is not None:
        arrays["exclude_input_in_output"] = np.array([[exclude_input_in_output]], dtype=bool)
    if end_id is not None:
        arrays["end_id"] = np.array([[end_id]], dtype=np.int32)
    if beam_width is not None and beam_width != 1:
        arrays["beam_width"] = np.array([[beam_width]], dtype=np.int32)
    arrays.update(extra or {})
    return _infer_inputs(arrays)


def is_llmapi(client, model: str) -> bool:
    """True if ``model`` speaks the llmapi contract (``trtmoe repo --layout llmapi``: ``text_input`` and
    ``sampling_param_*`` in, the whole text so far out)."""
    cfg = client.get_model_config(model, as_json=True)["config"]
    names = {i.get("name") for i in cfg.get("input", [])}
    return "text_input" in names and "sampling_param_max_tokens" in names


def build_llmapi_inputs(prompt: str, *, max_tokens: int, stream: bool, temperature: float | None = None,
                        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                        stop_words: list[str] | None = None, exclude_input_in_output: bool | None = None,
                        end_id: int | None = None, beam_width: int | None = None,
                        extra: dict[str, np.ndarray] | None = None) -> list:
    """The llmapi model's input tensors for one prompt (not batched: 1-D tensors). Its text never
    holds the prompt, so ``exclude_input_in_output`` False is refused, as are an end id and beams
    (the contract has no input for them)."""
    if exclude_input_in_output is False:
        raise InputError("the llmapi model returns the completion alone", hint="drop --include-input")
    if end_id is not None or (beam_width or 1) != 1:
        raise InputError("the llmapi model takes no end id or beam width",
                         hint="serve the default repository layout for those")
    arrays: dict[str, np.ndarray] = {
        "text_input": np.array([prompt.encode("utf-8")], dtype=object),
        "sampling_param_max_tokens": np.array([max_tokens], dtype=np.int32),
        "streaming": np.array([stream], dtype=bool),
    }
    for name, value, dtype in (("temperature", temperature, np.float32), ("top_k", top_k, np.int32),
                               ("top_p", top_p, np.float32), ("seed", seed, np.uint64)):
        if value is not None:
            arrays[f"sampling_param_{name}"] = np.array([value], dtype=dtype)
    if stop_words:
        arrays["sampling_param_stop"] = np.array([w.encode("utf-8") for w in stop_words], dtype=object)
    arrays.update(extra or {})
    return _infer_inputs(arrays)


def _text(result) -> str:
    texts = _texts(result)
    return texts[0] if texts else ""


def _texts(result) -> list[str]:
    """Every string of text_output (one per beam)."""
    arr = result.as_numpy("text_output")
    if arr is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in arr.reshape(-1)]


def _is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


_DECOUPLED: dict[tuple[str, str], bool] = {}  # (url, model) -> decoupled, refreshed by check=True calls
_LLMAPI: dict[tuple[str, str], bool] = {}  # (url, model) -> speaks the llmapi contract, refreshed likewise


_OUTPUTS = ("num_input_tokens", "num_output_tokens", "batch_index")


def _record_outputs(result: GenerateResult, res) -> None:
    for name in _OUTPUTS:
        arr = res.as_numpy(name)
        if arr is not None:
            result.outputs[name] = arr.reshape(-1)[0].item()
            if name == "num_output_tokens":
                result.output_token_counts.append(int(result.outputs[name]))


def _check_request_args(url: str, timeout_s: float, sampling: dict) -> None:
    """Refuse values no server could honour before connecting (so they are not reported as a
    connection failure)."""
    import math

    host, sep, port = str(url).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InputError(f"--url {url!r} must be host:port (the gRPC port, e.g. 127.0.0.1:8001)")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise InputError(f"timeout must be a positive number of seconds, got {timeout_s!r}")
    t, k, p = sampling.get("temperature"), sampling.get("top_k"), sampling.get("top_p")
    if t is not None and not (math.isfinite(t) and t >= 0):
        raise InputError(f"temperature must be a finite number >= 0, got {t!r}")
    if k is not None and k < 0:
        raise InputError(f"top_k must be >= 0, got {k!r}")
    if p is not None and not (math.isfinite(p) and 0 < p <= 1):
        raise InputError(f"top_p must be in (0, 1], got {p!r}")
    b = sampling.get("beam_width")
    if b is not None and b < 1:
        raise InputError(f"beam_width must be >= 1, got {b!r}")


def _default_model(client, url: str) -> str:
    """``ensemble``, unless the server has none and its ``tensorrt_llm`` is an llmapi model."""
    from tritonclient.utils import InferenceServerException

    try:
        names = {m.name for m in client.get_model_repository_index().models}
    except InferenceServerException:
        return "ensemble"  # the readiness check then says what is wrong
    if "ensemble" not in names and "tensorrt_llm" in names and is_llmapi(client, "tensorrt_llm"):
        return "tensorrt_llm"
    return "ensemble"


def _call_mode(client, url: str, model: str, *, stream: bool | None, unary: bool, check: bool) -> tuple[bool, bool]:
    """(decoupled, stream) for a call, refusing a combination the model cannot serve."""
    if check:
        _check_server(client, url, model)
    if check or (url, model) not in _DECOUPLED:
        _DECOUPLED[(url, model)] = is_decoupled(client, model)
    decoupled = _DECOUPLED[(url, model)]
    if unary and decoupled:
        raise InputError(f"model {model!r} is decoupled (it streams its responses), so Triton refuses unary "
                         "ModelInfer calls to it",
                         hint="call it through the gRPC stream API (drop --unary), or HTTP "
                              f"/v2/models/{model}/generate for a single non-streamed response")
    if stream is None:
        stream = decoupled and not unary
    if stream and not decoupled:
        raise InputError(f"model {model!r} is not decoupled, so it cannot stream tokens",
                         hint="call it without --stream, or regenerate the repository with "
                              "`trtmoe repo --streaming`")
    return decoupled, stream


def _infer_unary(client, model: str, inputs, result: GenerateResult, *, request_id: str, timeout_s: float,
                 on_text: Callable[[str], None] | None, beams: bool = False) -> GenerateResult:
    from tritonclient.utils import InferenceServerException

    t0 = time.perf_counter()
    try:
        res = client.infer(model, inputs, request_id=request_id, client_timeout=timeout_s)
    except InferenceServerException as e:
        raise TrtmoeError(f"{model}: {e.message()}") from None
    result.beams = _texts(res) if beams else []
    result.text = _text(res)
    result.pieces, result.response_times = [result.text], [time.perf_counter() - t0]
    _record_outputs(result, res)
    if on_text:
        on_text(result.text)
    result.total_s = result.response_times[-1]
    return result


def _infer_stream(client, model: str, inputs, result: GenerateResult, *, request_id: str, timeout_s: float,
                  on_text: Callable[[str], None] | None, beams: bool = False,
                  cumulative: bool = False) -> GenerateResult:
    """One request over the gRPC stream, collecting its responses until the final one. ``cumulative``:
    each response carries the whole text so far (the llmapi model); pieces are what each one adds."""
    so_far = ""
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error, time.perf_counter())))
    complete = False
    try:
        t0 = time.perf_counter()  # the stream is open: from here on it is the request's own time
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        deadline = t0 + timeout_s
        while True:
            try:
                res, err, t = responses.get(timeout=max(deadline - time.perf_counter(), 0.001))
            except queue.Empty:
                raise TrtmoeError(f"{model}: no final response within {timeout_s:.0f} s") from None
            if err is not None:
                raise TrtmoeError(f"{model}: {err.message() if hasattr(err, 'message') else err}")
            piece = _text(res)
            if cumulative:
                piece, so_far = piece[len(so_far):] if piece.startswith(so_far) else piece, piece
            final = _is_final(res)
            if beams and _texts(res):  # every response carries every beam so far: keep the latest
                result.beams = _texts(res)
            if piece or not final:
                result.pieces.append(piece)
                result.response_times.append(t - t0)
                if on_text and piece:
                    on_text(piece)
                _record_outputs(result, res)
            if final:
                complete = True
                break
    finally:
        # Cancel only an unfinished request: cancelling a finished one races with the ensemble's
        # own completion and leaves it holding the request until the server's exit timeout.
        client.stop_stream(cancel_requests=not complete)
    result.text = result.beams[0] if result.beams else "".join(result.pieces)
    result.total_s = time.perf_counter() - t0
    return result


def generate(url: str, prompt: str, *, model: str | None = "ensemble", max_tokens: int = 64,
             stream: bool | None = None,
             unary: bool = False, on_text: Callable[[str], None] | None = None, timeout_s: float = 300.0,
             request_id: str = "", check: bool = True, client: Any = None,
             exclude_input_in_output: bool | None = True, **sampling: Any) -> GenerateResult:
    """Generate text for ``prompt`` on the Triton gRPC endpoint ``url`` (``host:port``).

    ``model`` None: the ``ensemble``, or the ``tensorrt_llm`` model of an llmapi repository (``trtmoe repo
    --layout llmapi``) when the server has no ensemble; that model's contract is used whenever it is
    the one called. ``stream``: None streams whenever the model is decoupled. ``unary`` forces a unary ModelInfer
    call (refused for decoupled models). ``on_text(piece)`` sees each piece as it arrives.
    ``exclude_input_in_output``: True (default) asks for the completion alone; None leaves it to the
    repository's default (upstream's: the prompt is included in non-streamed outputs).
    ``sampling``: temperature, top_k, top_p, seed, stop_words, end_id, beam_width (the result's
    ``beams`` then holds every beam's text, best first; ``on_text`` is not called, since each
    response re-sends every beam), extra (a dict of additional input arrays). ``timeout_s`` bounds the whole call. ``check`` verifies the
    server and model first; without it the model's decoupled policy is looked up once per url.
    ``client``: a ``tritonclient.grpc.InferenceServerClient`` to reuse (one call at a time); it is
    left open. Raises InputError / BackendUnavailable / TrtmoeError.
    """
    if max_tokens < 1:
        raise InputError(f"max_tokens must be >= 1, got {max_tokens}")
    _check_request_args(url, timeout_s, sampling)
    own = client is None
    client = _client(url) if own else client
    try:
        if model is None:
            model = _default_model(client, url)
        decoupled, stream = _call_mode(client, url, model, stream=stream, unary=unary, check=check)
        if check or (url, model) not in _LLMAPI:
            _LLMAPI[(url, model)] = is_llmapi(client, model)
        llmapi = _LLMAPI[(url, model)]
        inputs = (build_llmapi_inputs if llmapi else build_inputs)(
            prompt, max_tokens=max_tokens, stream=stream, exclude_input_in_output=exclude_input_in_output, **sampling)
        result = GenerateResult(text="", streamed=stream, model=model)
        beams = (sampling.get("beam_width") or 1) > 1
        if decoupled:
            return _infer_stream(client, model, inputs, result, request_id=request_id, timeout_s=timeout_s,
                                 on_text=None if beams else on_text, beams=beams, cumulative=llmapi)
        return _infer_unary(client, model, inputs, result, request_id=request_id, timeout_s=timeout_s,
                            on_text=None if beams else on_text, beams=beams)
    finally:
        if own:
            client.close()
