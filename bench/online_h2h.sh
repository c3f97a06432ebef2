#!/usr/bin/env bash
# Online head-to-head: `pagoda serve` and `vllm serve` on the same model, one after the other on the
# same machine, each driven by `pagoda bench serve` (bench/latency.py) over the same concurrency sweep.
#
#   bash bench/online_h2h.sh MODEL_DIR OUT_DIR [pagoda] [vllm]
#
# MODEL_DIR needs a tokenizer (both servers detokenize). For a dummy-weight shape with no tokenizer of
# its own, `bash bench/online_h2h.sh --make-model SHAPE_DIR TOKENIZER_DIR NEW_DIR` writes SHAPE_DIR's
# config with TOKENIZER_DIR's vocabulary size and tokenizer files (e.g. the Llama-3-8B shape with the
# default model's tokenizer: the lm_head shrinks from 128,256 to 49,152 rows, for both servers alike).
#
# Environment: CONCURRENCY (default 1,4,16,64), PROMPTS_PER_USER (4), INPUT_LEN (512), OUTPUT_LEN (256),
# LOAD_FORMAT (dummy), PAGODA_ARGS, VLLM_ARGS (extra flags), VLLM_PYTHON (a python that imports vllm;
# default python3), SERVER_WAIT (seconds to wait for /health, default 600).
# Writes OUT_DIR/latency-<server>.json (one entry per concurrency), OUT_DIR/<server>.log,
# OUT_DIR/metrics-<server>.txt (its /metrics after the sweep) and
# OUT_DIR/latency-h2h.png (both curves).
set -uo pipefail

if [ "${1:-}" = "--make-model" ]; then
  shape=$2 tok=$3 new=$4
  mkdir -p "$new" && cp "$tok"/tokenizer*.json "$new"/ && cp "$tok"/chat_template.jinja "$new"/ 2>/dev/null
  python3 - "$shape" "$tok" "$new" <<'EOF'
import json, sys
shape, tok, new = sys.argv[1:]
config = json.load(open(f"{shape}/config.json"))
vocab = json.load(open(f"{tok}/config.json"))
for key in ("vocab_size", "bos_token_id", "eos_token_id"):
    config[key] = vocab[key]
json.dump(config, open(f"{new}/config.json", "w"), indent=2)
EOF
  exit $?
fi

MODEL=$1 OUT=$2
shift 2
SERVERS=${*:-pagoda vllm}
CONCURRENCY=${CONCURRENCY:-1,4,16,64}
INPUT_LEN=${INPUT_LEN:-512} OUTPUT_LEN=${OUTPUT_LEN:-256} LOAD_FORMAT=${LOAD_FORMAT:-dummy}
PORT=${PORT:-8765}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

wait_up() {  # pid
  for _ in $(seq "${SERVER_WAIT:-600}"); do
    kill -0 "$1" 2>/dev/null || return 1
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    sleep 1
  done
  return 1
}

for server in $SERVERS; do
  echo "=== $server $(date +%T)"
  case $server in
    pagoda) python3 -m server.cli serve "$MODEL" --port "$PORT" --load-format "$LOAD_FORMAT" \
              --served-model-name h2h --disable-uvicorn-access-log ${PAGODA_ARGS:-} > "$OUT/pagoda.log" 2>&1 & ;;
    vllm)   VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 ${VLLM_PYTHON:-python3} \
              -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PORT" \
              --load-format "$LOAD_FORMAT" --served-model-name h2h ${VLLM_ARGS:-} \
              > "$OUT/vllm.log" 2>&1 & ;;
    *) echo "unknown server $server"; continue ;;
  esac
  pid=$!
  if ! wait_up $pid; then
    echo "$server did not come up"; tail -20 "$OUT/$server.log"; kill $pid 2>/dev/null; continue
  fi
  python3 "$HERE/latency.py" --base-url "http://127.0.0.1:$PORT" --model h2h --label "$server" \
    --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
    --sweep-concurrency "$CONCURRENCY" --num-prompts 8 --prompts-per-concurrency "${PROMPTS_PER_USER:-4}" \
    --num-warmups 2 \
    --result-file "$OUT/latency-$server.json" --disable-tqdm 2>&1 | tail -40
  # The server's own view (queue time, TTFT and prefill histograms), for explaining a gap.
  curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics-$server.txt"
  kill $pid; wait $pid 2>/dev/null
done
files=$(ls "$OUT"/latency-*.json 2>/dev/null | grep -v h2h)
[ -n "$files" ] && python3 "$HERE/latency.py" plot $files --out "$OUT/latency-h2h.png"
