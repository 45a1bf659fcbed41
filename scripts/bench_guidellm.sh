#!/usr/bin/env bash
# Drive `deltaserve serve` with guidellm (a standard load generator): /v1/chat/completions, streamed, at fixed
# concurrencies, synthetic prompts of a fixed length; guidellm's console tables and its JSON report go to OUT.
#
#   scripts/bench_guidellm.sh [OUT_DIR] [deltaserve serve flags ...]
#   STREAMS=1,4,16 REQUESTS=64 PROMPT_TOKENS=256 OUTPUT_TOKENS=64 scripts/bench_guidellm.sh runs/guidellm
#
# The tokenizer guidellm counts tokens with is the served model's (TOKENIZER=DIR; default: the embedded tiny
# model's directory, or --model DIR when given). Everything stays on 127.0.0.1; the server is stopped at the end.
set -euo pipefail
OUT=${1:-runs/guidellm}
shift || true
PY=${PYTHON:-python}
PORT=${PORT:-8013}
STREAMS=${STREAMS:-1,4,16}
REQUESTS=${REQUESTS:-64}
PROMPT_TOKENS=${PROMPT_TOKENS:-256}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
mkdir -p "$OUT"

MODEL_DIR=""
prev=""
for a in "$@"; do [[ "$prev" == "--model" ]] && MODEL_DIR="$a"; prev="$a"; done
if [[ -z "${TOKENIZER:-}" ]]; then
  if [[ -n "$MODEL_DIR" ]]; then TOKENIZER="$MODEL_DIR"
  else TOKENIZER=$("$PY" -c "from deltaserve.embedded import ensure_model; print(ensure_model('tiny'))"); fi
fi

"$PY" -m deltaserve serve --host 127.0.0.1 --port "$PORT" --log-level warning "$@" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "the server exited; see $OUT/server.log" >&2; exit 1; }
  sleep 0.5
done
NAME=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | "$PY" -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")

HF_HUB_OFFLINE=1 guidellm run \
  --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=$NAME,request_format=/v1/chat/completions,stream=true" \
  --profile "{\"kind\": \"concurrent\", \"streams\": [$STREAMS]}" \
  --constraint "kind=max_requests,count=$REQUESTS" \
  --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
  --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
  --output "kind=json,path=$OUT/guidellm.json" --output kind=console \
  --disable-progress 2>&1 | tee "$OUT/guidellm.txt"
