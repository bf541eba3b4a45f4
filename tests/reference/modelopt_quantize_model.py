"""Run in ModelOpt's own environment (never imported by trtmoe): quantize an HF MoE model with one of
ModelOpt 0.47's configs, calibrating on given token windows, and export its unified-HF checkpoint.

Usage: python modelopt_quantize_model.py MODEL_DIR IDS.safetensors CFG_NAME OUT_DIR

IDS.safetensors holds ``ids`` [windows, tokens] (int64): the calibration windows, fed batch by batch
to ``mtq.quantize``'s forward loop. CFG_NAME is a config of ``modelopt.torch.quantization`` (e.g.
FP8_DEFAULT_CFG, NVFP4_DEFAULT_CFG, MXFP4_DEFAULT_CFG, W4A8_AWQ_BETA_CFG).
"""

import copy
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint


def main(model_dir: str, ids_path: str, cfg_name: str, out: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    model.eval()
    ids = load_file(ids_path)["ids"]

    def loop(m):
        with torch.no_grad():
            for b in ids.split(8):
                m(input_ids=b)

    cfg = copy.deepcopy(getattr(mtq, cfg_name))
    mtq.quantize(model, cfg, loop)
    export_hf_checkpoint(model, export_dir=out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
