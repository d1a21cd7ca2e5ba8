#!/bin/bash
# Serve the default model's GGUF with llama.cpp's llama-server and with streamserve, one after
# the other, ROUNDS times, and run the same streamed workload against each (bench_serving.py).
#
#   scripts/compare_llama_server.sh LLAMA_SERVER CONCURRENCY NUM_PROMPTS [ROUNDS] [OUT_DIR]
#
# LLAMA_SERVER: a llama-server binary (llama.cpp, built with -DGGML_NATIVE=ON for this CPU;
# its shared libraries beside it). Prompts of 20-50 random tokens, 64 tokens out each.
set -euo pipefail
LLAMA=$1; CONC=$2; N=$3; ROUNDS=${4:-2}; OUT=${5:-/tmp/compare_llama_server}
HERE=$(cd "$(dirname "$0")" && pwd)
GGUF=$(python -c "from streamserve.models.resolve import default_gguf_path; print(default_gguf_path())")
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
for r in $(seq 1 "$ROUNDS"); do
  for who in llama-server streamserve; do
    if [ $who = llama-server ]; then
      LD_LIBRARY_PATH=$(dirname "$LLAMA") "$LLAMA" -m "$GGUF" --port 8091 --parallel 16 -c 16384 -t "$(nproc)" \
        > "$OUT/$who.log" 2>&1 &
      PID=$!; URL=http://127.0.0.1:8091
    else
      # from another directory, so that a checkout here is not what Python imports as streamserve;
      # started directly (not in a subshell), so that $! is the server and kill stops it
      cd /tmp
      python -m streamserve --port 8090 > "$OUT/$who.log" 2>&1 &
      PID=$!; URL=http://127.0.0.1:8090; cd - > /dev/null
    fi
    for _ in $(seq 1 180); do curl -sf $URL/health > /dev/null && break; sleep 1; done
    python "$HERE/bench_serving.py" --url $URL --concurrency "$CONC" --num-prompts "$N" --prompt-len 20 50 \
      --output-len 64 64 --vocab 40000 --json "$OUT/${who}_c${CONC}_r$r.json" 2>&1 \
      | grep -E "served|ttft|itl" | sed "s/^/$who round $r: /"
    kill $PID; wait $PID 2>/dev/null || true; sleep 2
  done
done
