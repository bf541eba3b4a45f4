"""Triton Python model `postprocessing`: token ids -> text.

Tokens are decoded *in context*: behind a fixed anchor token whose text is then cut off, so a
streamed token keeps the leading space it has inside a sentence (SentencePiece-style tokenizers
drop it when a token is decoded alone) and the streamed pieces concatenate to the same text as one
non-streamed response. A response that starts with a special token (BOS: the prompt is included)
is decoded as is. Self-contained (numpy + transformers).
"""

from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


def _param(config: dict, key: str, default: str = "") -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    return default if not value or (value.startswith("$" + "{") and value.endswith("}")) else value


def _flag(config: dict, key: str, default: bool) -> bool:
    value = _param(config, key, "").strip().lower()
    return True if value in ("true", "1", "yes") else False if value in ("false", "0", "no") else default


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        path = _param(config, "tokenizer_dir")
        if not path:
            raise pb_utils.TritonModelException("parameter tokenizer_dir is not set")
        if not os.path.isabs(path):
            path = os.path.join(os.path.dirname(os.path.abspath(args["model_repository"])), path)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=_flag(config, "trust_remote_code", False))
        self.skip_special = _flag(config, "skip_special_tokens", True)
        tok = self.tokenizer
        self.special = set(tok.all_special_ids)
        anchor = tok.encode("a", add_special_tokens=False)
        self.anchor = anchor[-1:] if anchor else []
        self.anchor_text = tok.decode(self.anchor, skip_special_tokens=self.skip_special)

    def decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if not self.anchor or ids[0] in self.special:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        text = self.tokenizer.decode(self.anchor + ids, skip_special_tokens=self.skip_special)
        if text.startswith(self.anchor_text):
            return text[len(self.anchor_text):]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
                lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
                if tokens.ndim == 2:  # [batch, seq] without the beam axis
                    tokens = tokens[:, None, :]
                lengths = lengths.reshape(tokens.shape[0], -1)
                out = np.empty(tokens.shape[:2], dtype=object)
                for b in range(tokens.shape[0]):
                    for k in range(tokens.shape[1]):
                        n = int(lengths[b, k if lengths.shape[1] > 1 else 0])
                        out[b, k] = self.decode(tokens[b, k, :n].tolist()).encode("utf-8")
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
            except Exception as e:  # noqa: BLE001
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing: {e}")))
        return responses
