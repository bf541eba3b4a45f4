#!/usr/bin/env bash
# The main job end to end on a CPU machine, with the small trained MoE committed in this repo:
# inspect -> calibrate -> convert (graded, 4.5 bits per expert weight) -> verify -> run (embedded)
# -> build (embedded) -> Triton repository -> a real Triton server -> a gRPC answer.
# STREAMING=1 makes the repository decoupled (`trtmoe repo --streaming`): the answer then streams
# token by token; the default repository (upstream's default, not decoupled) answers in one piece.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-tests/fixtures/trained_mixtral}
OUT=${OUT:-out/demo}
PORT=${PORT:-18000}
PROMPT=${PROMPT:-"def read_config(path):"}
STREAMING=${STREAMING:-}
mkdir -p "$OUT"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "inspect: what the model costs and activates per token"
trtmoe inspect "$MODEL" --tp 2 --moe-ep 2

step "calibrate: routing statistics and per-matrix sensitivity (each expert's fc and proj)"
python3 -c "from trtmoe.data import write_split_text; write_split_text('calib', '$OUT/calib.txt', max_bytes=400_000)"
trtmoe calibrate "$MODEL" --data "$OUT/calib.txt" -o "$OUT/calib" --samples 8 --seq-len 128 --force

step "convert: graded per-matrix quantization at 4.5 bits per expert weight"
trtmoe convert "$MODEL" -o "$OUT/ckpt" --calib "$OUT/calib" --budget 4.5 --force
trtmoe verify "$OUT/ckpt"

step "run: the embedded engine executes the checkpoint (quantized experts from packed bytes)"
trtmoe run "$OUT/ckpt" -p "$PROMPT" -n 40

step "build: an embedded engine directory"
trtmoe build "$OUT/ckpt" -c build_configs/tiny-cpu.yaml -o "$OUT/engine" --force

step "repo: the Triton model repository"
trtmoe repo "$OUT/engine" -o "$OUT/repo" --force ${STREAMING:+--streaming}

step "serve + generate: a real Triton server, a gRPC answer (streamed when the repository is decoupled)"
trtmoe serve "$OUT/repo" --http-port "$PORT" --grpc-port $((PORT + 1)) --metrics-port $((PORT + 2)) \
    --log-file "$OUT/triton.log" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
python3 - "$PORT" <<'PY'
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/v2/health/ready"
for _ in range(600):
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        time.sleep(0.5)
sys.exit("Triton did not become ready; see the server log")
PY
trtmoe generate "$PROMPT" --url "127.0.0.1:$((PORT + 1))" -n 40
step "done: artifacts in $OUT"
