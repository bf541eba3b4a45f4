"""Triton Python model `postprocessing`: token ids -> text.

`OUTPUT` is 1-D per request, one string per (batch item, beam) as the TensorRT-LLM templates return
it, so clients read `result.as_numpy("text_output")[0].decode()`.

Tokens are decoded *in context*: behind a fixed anchor token whose text is then cut off, so a
streamed token keeps the leading space it has inside a sentence (SentencePiece-style tokenizers
drop it when a token is decoded alone) and the streamed pieces concatenate to the same text as one
non-streamed response. A response that starts with a special token (BOS: the prompt is included)
is decoded as is.

Self-contained: numpy and the `tokenizers` library (no transformers, no torch), reading the
repository's `tokenizer.json` and the special-token facts `trtmoe repo` resolved into
`trtmoe_tokenizer.json`. One thread: many of these processes share the machine with the engine.
"""

from __future__ import annotations

import os

for _var in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
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
                tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
                lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
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
