"""Run in ModelOpt's own environment (never imported by trtmoe): quantize the weights of an input
safetensors file with ModelOpt's quantizers and exporter rules, and write their packed tensors.

Usage: python modelopt_formats_oracle.py IN.safetensors OUT.safetensors [IN2 OUT2 ...]  (pairs, one process)

IN holds float weights ``<name>`` ([out, in], any float dtype) and, for formats with a static input
scale, ``<name>.input_amax`` (a scalar). OUT gets ``<name>.<fmt>.<suffix>`` for every format below,
computed the way ModelOpt 0.47's unified-HF export does (modelopt/torch/export/quant_utils.py,
qtensor/*.py), plus ``<name>.<fmt>.fake_input`` (the inputs ``<name>.x`` quantized and dequantized: FP8 by ModelOpt's CPU
fake quantizer, NVFP4 by its block quantizer under the static global input scale) and
``<name>.<fmt>.dequantized`` (ModelOpt's own dequantization of the NVFP4 and MXFP4 tensors).
"""

import sys

import torch
from safetensors.torch import load_file, save_file

from modelopt.torch.export.quant_utils import get_scaling_factor_from_weight, to_quantized_weight
from modelopt.torch.quantization.qtensor import MXFP4QTensor, NVFP4QTensor
from modelopt.torch.quantization.tensor_quant import fp8_eager
from modelopt.torch.quantization.utils import reduce_block_amax, reduce_block_padding


def main(src: str, dst: str) -> None:
    t = load_file(src)
    out = {}
    for name, w in t.items():
        if name.endswith(".input_amax") or name.endswith(".x"):
            continue
        amax_in = t.get(f"{name}.input_amax")
        # FP8 per tensor: weight_scale = amax / 448 (get_scaling_factor), weight = (w / s) -> e4m3.
        s = w.abs().amax().float() / 448.0
        out[f"{name}.fp8.weight"] = to_quantized_weight(w, s, "fp8")
        out[f"{name}.fp8.weight_scale"] = s
        if amax_in is not None:
            out[f"{name}.fp8.input_scale"] = amax_in.float() / 448.0
            x = t.get(f"{name}.x")
            if x is not None:
                out[f"{name}.fp8.fake_input"] = fp8_eager(x.float(), amax_in.float())
        # FP8 128x128 blocks (fp8_pb_wo): the exporter's weight_scale is the calibrated per-block
        # amax (float32) / 448, and the weight is quantized with it (to_quantized_weight).
        blocks = {-1: 128, -2: 128}
        bs = reduce_block_amax(reduce_block_padding(w, blocks), blocks).float() / 448.0
        out[f"{name}.fp8_block_wo.weight"] = to_quantized_weight(w, bs, "fp8_pb_wo", None, 128)
        out[f"{name}.fp8_block_wo.weight_scale"] = bs.reshape(-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        # NVFP4: weight_scale_2 = amax / (6 * 448), E4M3 block scales of 16, packed E2M1.
        s2 = NVFP4QTensor.get_weights_scaling_factor_2(w)
        ws, _ = NVFP4QTensor.get_weights_scaling_factor(w, 16, s2)
        out[f"{name}.nvfp4.weight"] = to_quantized_weight(w, ws, "nvfp4", s2, 16)
        out[f"{name}.nvfp4.weight_scale"] = ws
        out[f"{name}.nvfp4.weight_scale_2"] = s2
        qt, _, _ = NVFP4QTensor.quantize(w, 16, ws, s2)
        out[f"{name}.nvfp4.dequantized"] = qt.dequantize(torch.float32, scale=ws, double_scale=s2,
                                                         block_sizes={-1: 16})
        if amax_in is not None:
            gs = amax_in.float() / (6.0 * 448.0)
            out[f"{name}.nvfp4.input_scale"] = gs
            x = t.get(f"{name}.x")
            if x is not None:  # the activations under the static global scale, by the weight's rule
                xs, _ = NVFP4QTensor.get_weights_scaling_factor(x.float(), 16, gs)
                xq, _, _ = NVFP4QTensor.quantize(x.float(), 16, xs, gs)
                out[f"{name}.nvfp4.fake_input"] = xq.dequantize(torch.float32, scale=xs, double_scale=gs,
                                                                block_sizes={-1: 16})
        # MXFP4: E8M0 scales of 32, packed E2M1.
        q, e = MXFP4QTensor.quantize(w, block_size=32)
        out[f"{name}.mxfp4.weight"] = q._quantized_data
        out[f"{name}.mxfp4.weight_scale"] = e.reshape(*w.shape[:-1], -1)
        out[f"{name}.mxfp4.dequantized"] = q.dequantize(torch.float32, scale=e, block_sizes={-1: 32})
        # W4A8 AWQ (no smoothing): int4 group 128 (amax / 7), packed in output-row pairs.
        if w.shape[-1] % 128:
            continue
        s4 = get_scaling_factor_from_weight(w, 128)
        out[f"{name}.w4a8_awq.weight"] = to_quantized_weight(w, s4, "w4a8_awq", None, 128)
        out[f"{name}.w4a8_awq.weight_scale"] = s4
    save_file({k: v.contiguous() for k, v in out.items()}, dst)


if __name__ == "__main__":
    pairs = sys.argv[1:]
    if not pairs or len(pairs) % 2:
        sys.exit("usage: modelopt_formats_oracle.py IN.safetensors OUT.safetensors [IN2 OUT2 ...]")
    for i in range(0, len(pairs), 2):
        main(pairs[i], pairs[i + 1])
