"""Quantization: the formats' numerics (``formats``), calibration, sensitivity, allocation, policies.

``QUANTIZED_NAMES`` names the quantized storage formats without importing torch, for the command
line's choices and the YAML schema; ``trtmoe.quant.formats.QUANTIZED`` derives the same tuple from the
format objects (a test keeps them equal) and ``BY_BITS`` orders them from most to fewest stored bits."""

QUANTIZED_NAMES = ("int8", "int4", "int4_g128", "int4_g64",
                   "fp8", "fp8_block", "fp8_block_wo", "nvfp4", "nvfp4_w4a16", "mxfp4", "w4a8_awq")
# The formats TensorRT-LLM 1.2's engine path builds (``QuantFormat.engine_path``, kept equal by a test):
# what calibration measures unless told otherwise. The others are the PyTorch backend's fused-MoE
# formats (FP8, FP8 block scales, NVFP4, MXFP4, W4A8 AWQ), chosen with ``--formats``.
ENGINE_PATH_NAMES = ("int8", "int4", "int4_g128", "int4_g64")
FLOAT_NAMES = ("float", "fp16", "bf16", "fp32")  # ways to say "unquantized"
# INT4 roundings (trtmoe.quant.awq.ROUNDINGS, kept equal by a test): round to nearest, activation-aware
# scale and clip search, error-feedback codes, and both.
ROUNDING_NAMES = ("rtn", "awq", "gptq", "awq_gptq")
