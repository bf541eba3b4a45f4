"""Triton Python model `postprocessing`: token ids -> text.

`OUTPUT` is 1-D per request, one string per (batch item, beam) as the TensorRT-LLM templates return
it, so clients read `result.as_numpy("text_output")[0].decode()`.

Tokens are decoded *in context*: behind a fixed anchor token whose text is then cut off, so a
streamed token keeps the leading space it has inside a sentence (SentencePiece-style tokenizers
drop it when a token is decoded alone) and the streamed pieces concatenate to the same text as one
non-streamed response. A response that starts with a special token (BOS: the prompt is included)
is decoded as is.

Cancellation through the ensemble: Triton 2.51's ensemble scheduler does not tell the running
tensorrt_llm step that its request was cancelled; it marks only the steps it schedules afterwards,
and in a streaming repository that is this model, once per streamed response. So a request that
carries the ensemble's `REQUEST_KEY` and is cancelled makes this model send `cancel_stop_model`
(tensorrt_llm) the key, on a thread of its own, once per key: over tensorrt_llm's cancel socket
(trtmoe.triton.cancel_channel, which no full request queue can refuse) where there is one, else as
a `stop` request (the flag is read at most every `cancellation_check_period_ms` per key, default
20: each read is IPC); tensorrt_llm then ends that generation before its next decode step. The cancelled request is still answered
normally (the ensemble then finishes as usual; the client is gone and gets nothing). Such a
repository has no dynamic batcher for this model: a batcher drops cancelled requests unseen.

Self-contained: numpy and the `tokenizers` library (no transformers, no torch), reading the
repository's `tokenizer.json` and the special-token facts `trtmoe repo` resolved into
`trtmoe_tokenizer.json`. One thread: many of these processes share the machine with the engine.
"""

from __future__ import annotations

import os

for _var in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gc  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import OrderedDict  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from trtmoe_cancel_channel import CancelSender  # noqa: E402 - copied beside this file by `trtmoe repo`
from tokenizers import Tokenizer  # noqa: E402


def _param(config: dict, key: str, default: str = "") -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    return default if not value or (value.startswith("$" + "{") and value.endswith("}")) else value


def _flag(config: dict, key: str, default: bool) -> bool:
    value = _param(config, key, "").strip().lower()
    return True if value in ("true", "1", "yes") else False if value in ("false", "0", "no") else default


def _cleanup(text: str) -> str:
    """transformers' clean_up_tokenization (for tokenizers configured with it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        path = _param(config, "tokenizer_dir")
        if not path:
            raise pb_utils.TritonModelException("parameter tokenizer_dir is not set")
        if not os.path.isabs(path):  # relative to the repository root (the parent of this model's folder)
            path = os.path.join(os.path.dirname(os.path.abspath(args["model_repository"])), path)
        self.tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "trtmoe_tokenizer.json")) as f:
            facts = json.load(f)
        self.skip_special = _flag(config, "skip_special_tokens", True)
        self.cleanup = bool(facts.get("clean_up_tokenization_spaces", False))
        self.special = set(facts.get("special_ids", []))
        anchor = self.tokenizer.encode("a", add_special_tokens=False).ids
        self.anchor = anchor[-1:] if anchor else []
        self.anchor_text = self._decode(self.anchor)
        self.stop_model = _param(config, "cancel_stop_model", "")
        # is_cancelled() is an IPC round trip: ask it at most once per period per key, not per response
        self.check_period_s = float(_param(config, "cancellation_check_period_ms", "20")) / 1000.0
        self.checked: OrderedDict[str, float] = OrderedDict()  # key -> when it was last asked (latest keys)
        self.stopped: OrderedDict[str, None] = OrderedDict()  # keys already stopped (the latest ones)
        self.stops: queue.Queue = queue.Queue()
        self.sender = CancelSender(self.stop_model) if self.stop_model else None
        if self.stop_model:
            threading.Thread(target=self._stop_loop, name="postprocessing-stop", daemon=True).start()

        # What initialize loaded lives as long as the model: keep it out of the collector, whose full
        # passes over it (several ms) would otherwise stall the responses passing through.
        gc.collect()
        gc.freeze()

    # -- cancellation ------------------------------------------------------------------------
    def _cancelled_key(self, request, key) -> str | None:
        """The request's key when it is cancelled and its generation was not stopped yet."""
        if not self.stop_model:
            return None
        if key is None:  # not from the ensemble (BLS detokenizes without one)
            return None
        key = key.as_numpy().reshape(-1)[0]
        key = key.decode() if isinstance(key, bytes) else str(key)
        now = time.monotonic()
        if key in self.stopped or now - self.checked.get(key, -1e9) < self.check_period_s:
            return None
        self.checked[key] = now
        self.checked.move_to_end(key)
        while len(self.checked) > 4096:
            self.checked.popitem(last=False)
        try:
            if not request.is_cancelled():
                return None
        except Exception:  # noqa: BLE001 - Triton cannot say: the client is most likely gone, stop it
            pass
        self.stopped[key] = None
        while len(self.stopped) > 4096:
            self.stopped.popitem(last=False)
        return key

    def _stop_loop(self):
        while True:
            key = self.stops.get()
            if key is None:
                return
            if self.sender is not None:
                try:
                    self.sender.send(key)
                    continue
                except OSError:  # nobody listens (not the embedded engine): the stop request below
                    pass
            inputs = [pb_utils.Tensor("input_ids", np.zeros([1, 1], np.int32)),
                      pb_utils.Tensor("input_lengths", np.zeros([1, 1], np.int32)),
                      pb_utils.Tensor("request_output_len", np.zeros([1, 1], np.int32)),
                      pb_utils.Tensor("stop", np.array([[True]], dtype=bool)),
                      pb_utils.Tensor("request_key", np.array([[key.encode()]], dtype=object))]
            try:
                req = pb_utils.InferenceRequest(model_name=self.stop_model, requested_output_names=[], inputs=inputs)
                for resp in req.exec(decoupled=True):
                    if resp.has_error():
                        pb_utils.Logger.log_warn(f"postprocessing: stop of {key} failed: {resp.error().message()}")
            except Exception as e:  # noqa: BLE001 - best effort: the generation then runs to its end
                pb_utils.Logger.log_warn(f"postprocessing: stop of {key} failed: {e}")

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        return _cleanup(text) if self.cleanup else text

    def decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if not self.anchor or ids[0] in self.special:
            return self._decode(ids)
        text = self._decode(self.anchor + ids)
        if text.startswith(self.anchor_text):
            return text[len(self.anchor_text):]
        return self._decode(ids)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                # One pass over the inputs: get_input_tensor_by_name rebuilds them on every call.
                inputs = {t.name(): t for t in request.inputs()}
                key = self._cancelled_key(request, inputs.get("REQUEST_KEY"))
                if key is not None:
                    self.stops.put(key)
                tokens = inputs["TOKENS_BATCH"].as_numpy()
                lengths = inputs["SEQUENCE_LENGTH"].as_numpy()
                if tokens.ndim == 2:  # [batch, seq] without the beam axis
                    tokens = tokens[:, None, :]
                lengths = lengths.reshape(tokens.shape[0], -1)
                texts = []
                for b in range(tokens.shape[0]):
                    for k in range(tokens.shape[1]):
                        n = int(lengths[b, k if lengths.shape[1] > 1 else 0])
                        texts.append(self.decode(tokens[b, k, :n].tolist()).encode("utf-8"))
                out = np.array(texts, dtype=object)  # 1-D: [batch x beams]
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
            except Exception as e:  # noqa: BLE001
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing: {e}")))
        return responses

    def finalize(self):
        self.stops.put(None)
