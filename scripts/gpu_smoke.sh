#!/usr/bin/env bash
# GPU smoke test of the TensorRT-LLM path, end to end:
#   trained fixture -> trtmoe convert -> trtmoe build --backend tensorrt-llm -> trtmoe repo
#   -> trtmoe serve (the image's tritonserver + tensorrtllm backend) -> trtmoe generate (gRPC),
# and the greedy text of every prompt compared with the embedded engine's on the same checkpoint
# (trtmoe run --json).
#
# Run it on a GPU host inside the image built from this repository's Dockerfile:
#   docker build -t trtmoe .
#   docker run --rm --gpus all --shm-size=2g trtmoe scripts/gpu_smoke.sh
#
# Settings (environment): FIXTURE, WORK (kept when given; a fresh temp dir otherwise), DTYPE,
# MAX_TOKENS, HTTP_PORT / GRPC_PORT / METRICS_PORT, SERVE_TIMEOUT (seconds).
# Exit status: 0 when every prompt matches, 1 on any failure or mismatch.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

FIXTURE=${FIXTURE:-tests/fixtures/trained_mixtral}
DTYPE=${DTYPE:-float16}           # TensorRT-LLM's fused attention kernels are fp16/bf16 kernels
MAX_TOKENS=${MAX_TOKENS:-16}
HTTP_PORT=${HTTP_PORT:-18000}
GRPC_PORT=${GRPC_PORT:-18001}
METRICS_PORT=${METRICS_PORT:-18002}
SERVE_TIMEOUT=${SERVE_TIMEOUT:-600}
PROMPTS=("def main(" "import os" "class Parser")

if [[ -n "${WORK:-}" ]]; then
    KEEP_WORK=1
    mkdir -p "$WORK"
else
    KEEP_WORK=0
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/trtmoe-smoke.XXXXXX")
fi
SERVER_PID=""

log() { printf '\n== %s\n' "$*" >&2; }

cleanup() {
    local rc=$?
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -INT "$SERVER_PID" 2>/dev/null || true   # trtmoe serve stops tritonserver cleanly on SIGINT
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    if (( rc != 0 )); then
        for f in "$WORK/serve.out" "$WORK/tritonserver.log"; do
            [[ -f "$f" ]] && { echo "--- tail of $f" >&2; tail -n 40 "$f" >&2; }
        done
        echo "gpu_smoke: FAILED (work dir kept: $WORK)" >&2
    elif (( KEEP_WORK == 0 )); then
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT

[[ -f "$FIXTURE/config.json" ]] || { echo "fixture not found: $FIXTURE" >&2; exit 1; }
command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: run with --gpus all on a GPU host" >&2; exit 1; }
nvidia-smi -L >&2

log "convert $FIXTURE ($DTYPE, tp=1, layer-granular for TensorRT-LLM)"
trtmoe convert "$FIXTURE" -o "$WORK/ckpt" --dtype "$DTYPE" --target tensorrt-llm
trtmoe verify "$WORK/ckpt"

BUILD_ARGS=(--backend tensorrt-llm --max-batch-size 8 --max-input-len 256 --max-seq-len 512
            --max-num-tokens 2048 --tokens-per-block 32)
log "build: dry run (command and memory estimate)"
trtmoe build "$WORK/ckpt" -o "$WORK/engine" "${BUILD_ARGS[@]}" --dry-run
log "build: trtllm-build"
trtmoe build "$WORK/ckpt" -o "$WORK/engine" "${BUILD_ARGS[@]}"
trtmoe verify "$WORK/engine"

log "repo"
trtmoe repo "$WORK/engine" --tokenizer "$WORK/ckpt/tokenizer" -o "$WORK/repo"

log "serve (http $HTTP_PORT, grpc $GRPC_PORT, metrics $METRICS_PORT)"
trtmoe serve "$WORK/repo" --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" \
    --timeout "$SERVE_TIMEOUT" --log-file "$WORK/tritonserver.log" >"$WORK/serve.out" 2>&1 &
SERVER_PID=$!
deadline=$((SECONDS + SERVE_TIMEOUT))
until python3 - "$HTTP_PORT" <<'EOF'
import sys, urllib.request
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v2/health/ready", timeout=5) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
EOF
do
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "trtmoe serve exited before the server was ready" >&2; exit 1; }
    (( SECONDS < deadline )) || { echo "server not ready after ${SERVE_TIMEOUT}s" >&2; exit 1; }
    sleep 2
done
echo "server ready" >&2

log "generate over gRPC (greedy: top_k 1), $MAX_TOKENS tokens per prompt"
for i in "${!PROMPTS[@]}"; do
    trtmoe generate "${PROMPTS[$i]}" --url "127.0.0.1:$GRPC_PORT" -n "$MAX_TOKENS" --top-k 1 --json \
        >"$WORK/triton_$i.json"
done

log "embedded engine on the same checkpoint (greedy)"
RUN_ARGS=()
for p in "${PROMPTS[@]}"; do RUN_ARGS+=(-p "$p"); done
trtmoe run "$WORK/ckpt" "${RUN_ARGS[@]}" -n "$MAX_TOKENS" --json >"$WORK/embedded.json"

log "compare"
python3 - "$WORK" "${#PROMPTS[@]}" <<'EOF'
import json, sys
from pathlib import Path

work, n = Path(sys.argv[1]), int(sys.argv[2])
embedded = json.loads((work / "embedded.json").read_text())
bad = 0
for i in range(n):
    triton = json.loads((work / f"triton_{i}.json").read_text())["text"]
    ref = embedded[i]["text"]
    prompt = embedded[i]["prompt"]
    if triton == ref:
        print(f"match     {prompt!r} -> {ref!r}")
        continue
    bad += 1
    same = next((k for k, (a, b) in enumerate(zip(triton, ref)) if a != b), min(len(triton), len(ref)))
    note = " (equal up to whitespace)" if triton.split() == ref.split() else ""
    print(f"MISMATCH  {prompt!r}: first difference at character {same}{note}\n"
          f"  tensorrt-llm via triton: {triton!r}\n  embedded engine:         {ref!r}")
print(f"{n - bad}/{n} prompts match")
sys.exit(1 if bad else 0)
EOF

echo "gpu_smoke: OK" >&2
