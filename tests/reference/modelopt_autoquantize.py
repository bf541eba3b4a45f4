"""Run in ModelOpt's own environment (never imported by trtmoe): ModelOpt 0.47's AutoQuantize
(``mtq.auto_quantize``) of an HF MoE model's routed experts, and the per-layer formats it chose.

Usage: python modelopt_autoquantize.py MODEL_DIR IDS.safetensors EXPERT_BITS FORMATS METHOD OUT.json [EXPORT_DIR]

IDS.safetensors holds ``ids`` [windows, tokens] (int64), the calibration windows: batches of 8 are
both the calibration data and the scoring data. FORMATS is a comma list of ModelOpt config names
(e.g. FP8_DEFAULT_CFG,NVFP4_DEFAULT_CFG); NAME@BITS sets that config's ``effective_bits``, the cost
AutoQuantize counts for it (ModelOpt 0.47 counts MXFP4 as 4.0 bits, its E8M0 scales left out: 4.25
stored; FP8 as 8.0 and NVFP4 as 4.5, as stored). METHOD is ``gradient`` (loss = next-token cross entropy
of the windows themselves) or ``kl_div``. Only the routed experts are searched (every other linear
layer is disabled, as trtmoe keeps them in the model dtype). AutoQuantize's ``effective_bits``
counts every linear weight, disabled ones at 16 bits, so EXPERT_BITS (average bits of the routed
experts' weights, trtmoe's budget) is turned into the whole-model figure
(experts * EXPERT_BITS + others * 16) / (experts + others). OUT.json: {"expert_bits", "bits" (the
whole-model constraint), "method", "layers": {MoE layer index: chosen ModelOpt config name or
"NONE"}, "groups": {search group: recipe}, "best", "seconds"}. With EXPORT_DIR, the searched model is
also exported there by ModelOpt's ``export_hf_checkpoint`` (a unified-HF checkpoint, MIXED_PRECISION
when the layers differ).
"""

import copy
import json
import re
import sys
import time

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import modelopt.torch.quantization as mtq
from modelopt.torch.quantization import tensor_quant
from modelopt.torch.quantization.qtensor import NVFP4QTensor

_cuda_block_op = tensor_quant.dynamic_block_quantize_op


def _block_op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
    """NVFP4 fake quantization on CPU: ModelOpt 0.47's dynamic-block kernel asserts CUDA, so on CPU the
    same numbers come from ModelOpt's own NVFP4QTensor quantize/dequantize (the exporter's code):
    global scale amax / (6 * 448), E4M3 block scales of 16, E2M1 values."""
    if inputs.is_cuda or (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) != (4, 2, 8, 4):
        return _cuda_block_op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits,
                              scale_exponent_bits)
    s2 = amax.float().amax() / (6.0 * 448.0)
    x = inputs.reshape(-1, inputs.shape[-1])
    q, s, s2 = NVFP4QTensor.quantize(x, block_size, weights_scaling_factor_2=s2)
    y = q.dequantize(dtype=inputs.dtype, scale=s, double_scale=s2, block_sizes={-1: block_size})
    return y.reshape(inputs.shape)


tensor_quant.dynamic_block_quantize_op = _block_op


def main(model_dir: str, ids_path: str, bits: str, formats: str, method: str, out: str,
         export_dir: str | None = None) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    model.eval()
    ids = load_file(ids_path)["ids"]
    batches = list(ids.split(8))

    def forward_step(m, b):
        return m(input_ids=b).logits

    def loss_func(logits, b):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), b[:, 1:].flatten())

    disabled = [n + "*" for n, mod in model.named_modules()
                if isinstance(mod, torch.nn.Linear) and ".experts" not in n]
    n_exp = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and p.dim() >= 2)
    n_other = sum(mod.weight.numel() for n, mod in model.named_modules()
                  if isinstance(mod, torch.nn.Linear) and ".experts" not in n)
    expert_bits = float(bits)
    bits = (n_exp * expert_bits + n_other * 16.0) / (n_exp + n_other)
    t0 = time.time()
    kw = {"loss_func": loss_func} if method == "gradient" else {}
    cfgs, names = [], {}
    for i, f in enumerate(formats.split(",")):
        name, _, eb = f.partition("@")
        cfg = getattr(mtq, name)
        if eb:  # a changed config is a custom format to AutoQuantize, shown as CUSTOM_<index>
            cfg = dict(copy.deepcopy(cfg), effective_bits=float(eb))
            names[f"CUSTOM_{i}"] = name
        cfgs.append(cfg)
    model, state = mtq.auto_quantize(
        model, constraints={"effective_bits": float(bits)},
        quantization_formats=cfgs,
        data_loader=batches, forward_step=forward_step, disabled_layers=disabled,
        num_calib_steps=len(batches), num_score_steps=len(batches), method=method, verbose=True, **kw)
    groups, layers = {}, {}
    for gname, recipe in state["best"]["recipe"].items():
        groups[gname] = str(recipe)
        m = re.match(r"^model\.layers\.(\d+)\.\w+\.experts\.", gname)
        if m:
            chosen = str(recipe).split("(")[0]
            layers[int(m.group(1))] = names.get(chosen, chosen)
    with open(out, "w") as f:
        json.dump({"expert_bits": expert_bits, "bits": bits, "method": method, "layers": layers,
                   "groups": groups,
                   "best": {k: (v if isinstance(v, (int, float, bool, str)) else str(v))
                            for k, v in state["best"].items() if k != "recipe"},
                   "seconds": time.time() - t0}, f, indent=1)
    if export_dir:
        from modelopt.torch.export import export_hf_checkpoint

        with torch.inference_mode():
            export_hf_checkpoint(model, export_dir=export_dir)


if __name__ == "__main__":
    main(*sys.argv[1:8])
