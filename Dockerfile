# trtmoe on the NGC Triton Inference Server image that carries TensorRT-LLM 1.2.x: convert, build
# TensorRT-LLM engines with trtllm-build, generate the model repository and serve it with the
# image's own tritonserver and tensorrtllm backend, all in one image (engines must be built and
# served by the same TensorRT / TensorRT-LLM build).
#
# Base image evidence: the "Container Name: trtllm-python-py3" table of
# triton-inference-server/server docs/introduction/compatibility.md lists
#   25.12, 26.01, 26.02  -> TensorRT-LLM 1.1.0
#   26.03                -> TensorRT-LLM 1.2.0
#   26.04 ... 26.07      -> TensorRT-LLM 1.2.1, Python 3.12.3, torch 2.10.0a0+b4e4ee81d3.nv25.12,
#                           TensorRT 10.14.1.48, CUDA 13.1.0.036 (driver 590.44.01)
# 26.04 is the first release paired with 1.2.1, the latest TensorRT-LLM release line that still has
# the trtllm-build engine path (it was removed from TensorRT-LLM main in July 2026). 26.05-26.07
# carry the same TensorRT-LLM, TensorRT and torch; pass --build-arg BASE_IMAGE=... to use one.
#
#   docker build -t trtmoe .
#   docker run --rm --gpus all -v "$PWD/work:/work" trtmoe \
#       trtmoe build /work/ckpt -o /work/engine --backend tensorrt-llm -c build_configs/mixtral-8x7b-ep8.yaml
#   docker run --rm --gpus all -v "$PWD/work:/work" trtmoe trtmoe repo /work/engine -o /work/repo
#   docker run --rm --gpus all --shm-size=2g -p 8000-8002:8000-8002 -v "$PWD/work:/work" trtmoe \
#       trtmoe serve /work/repo --host 0.0.0.0
#   docker run --rm --gpus all trtmoe scripts/gpu_smoke.sh
#
# The PyTorch-backend path (TensorRT-LLM 1.2.1 in this image; 1.4 with a newer trtllm image as
# BASE_IMAGE, where the engine path above no longer exists): a ModelOpt unified-HF checkpoint, no build
# step, served by trtllm-serve or by Triton's llmapi model (docs/deploy-gpu.md):
#   docker run --rm -v "$PWD/work:/work" trtmoe trtmoe convert /work/hf -o /work/hf-fp8 \
#       --target trtllm-pytorch --layer-format '*=fp8' --calib-ids /work/ids.json
#   docker run --rm --gpus all -p 8000:8000 -v "$PWD/work:/work" trtmoe \
#       trtllm-serve /work/hf-fp8 --backend pytorch --host 0.0.0.0 --port 8000
#   docker run --rm -v "$PWD/work:/work" trtmoe trtmoe repo /work/hf-fp8 -o /work/repo-llmapi
#   docker run --rm -v "$PWD/work:/work" trtmoe trtmoe serve /work/repo-llmapi --print-command
ARG BASE_IMAGE=nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_CONSTRAINT=/opt/trtmoe/image-constraints.txt \
    TRTMOE_MODEL_REPO_TEMPLATES=/opt/trtmoe/model_repo

WORKDIR /opt/trtmoe

# Freeze every package the image ships (its torch 2.10 NV build, numpy<2, transformers and the rest
# of TensorRT-LLM 1.2.1's pins) as constraints, so nothing installed below, or later in the
# container, can replace them. Fail early if the base image lacks TensorRT-LLM 1.2.x.
RUN python3 -m pip list --format=freeze > /opt/trtmoe/image-constraints.txt && \
    python3 -c "import importlib.metadata as m; v = m.version('tensorrt_llm'); \
print('torch', m.version('torch'), '| tensorrt_llm', v); assert v.startswith('1.2.'), v"

COPY pyproject.toml README.md ./
COPY trtmoe ./trtmoe
COPY model_repo ./model_repo
COPY build_configs ./build_configs
COPY scripts ./scripts
COPY tests/fixtures ./tests/fixtures

# pyproject.toml pins torch==2.13.0, the CPU build the project is tested with; here TensorRT-LLM
# needs the image's own torch, so trtmoe goes in without dependencies and its other dependencies
# are installed under the image's constraints (PIP_CONSTRAINT above). trtmoe's code runs on either
# torch. tritonclient is the gRPC client of `trtmoe generate`; the server is the image's own
# /opt/tritonserver, so nvidia-pytriton (the CPU-only server) is not installed. The wheel is built
# with the image's own setuptools (--no-build-isolation) so the constraints hold for the build too.
RUN python3 -m pip install --no-deps --no-build-isolation . && \
    python3 -m pip install "safetensors>=0.4" numpy "click>=8.1" "rich>=13" "pyyaml>=6" \
        "huggingface_hub>=0.24" "tokenizers>=0.19" "matplotlib>=3.7" "scipy>=1.10" \
        "tritonclient[grpc,http]>=2.50" && \
    python3 -c "import importlib.metadata as m; \
want = [l.strip() for l in open('image-constraints.txt') if l.lower().startswith('torch==')][0]; \
got = 'torch==' + m.version('torch'); assert want.lower() == got.lower(), (want, got); print('unchanged:', got)" && \
    trtmoe --version && trtmoe build --help > /dev/null

# Triton's HTTP, gRPC and metrics ports (`trtmoe serve --host 0.0.0.0`).
EXPOSE 8000 8001 8002

# The image's own entrypoint stays (it prints the NGC banner and sets up the environment); the
# command is whatever follows the image name: trtmoe build / repo / serve / generate, or a script.
CMD ["trtmoe", "--help"]
