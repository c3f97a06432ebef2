# H100 calls (nvidia-h100-x1). vLLM 0.26.0 staged first:
#   run(carry=[".peers", ".vllm_whl/p1"]) bash .peers/vllm_h100.sh stage 1
#   run(carry=[".peers", ".vllm_whl/p2"]) bash .peers/vllm_h100.sh stage 2 && bash .peers/vllm_h100.sh install; then
#   PYTHONPATH=/root/vb_site:$PWD python3 bench/gpu_check.py kernels; BENCH_TIMEOUT=240 bash .peers/vllm_h100.sh bench w1 w2;
#   python3 bench/gpu_check.py workload w1|w2 --backend triton        (rows: ../2026-11-23-h100-d4fd401-gpu-check.jsonl, call 6;
#                                                                      vLLM: ../2026-11-23-h100-d4fd401-vllm.jsonl)
# Server wheels (carry [".whl", ".h2h"]): pip install -q --no-deps --target /tmp/site .whl/*.whl; pip install -q --no-deps --no-build-isolation .
# c64-both/ (call 7, same machine as the vLLM rows above, commit d384668):
CONCURRENCY=64 PYTHONPATH=/root/vb_site:/tmp/site bash bench/online_h2h.sh .h2h/llama3-8b-smoltok $OUT/h2h pagoda vllm
# tuned-both/ (call 8, same machine): vLLM with a 16,384-token step budget; pagoda with 16,384 and prompt graphs
# to 2,048 tokens ran out of GPU memory in its first steps (pagoda-oom.log: the piecewise graphs held 5.46 GiB)
CONCURRENCY=4,64 PAGODA_ARGS="--max-num-batched-tokens 16384 --max-prefill-graph-tokens 2048" \
  VLLM_ARGS="--max-num-batched-tokens 16384" PYTHONPATH=/root/vb_site:/tmp/site bash bench/online_h2h.sh .h2h/llama3-8b-smoltok $OUT/tuned pagoda vllm
# tuned-pagoda/ and c4-pagoda-default/ (call 11, a fresh machine, after the one-capture-stream fix:
# the same graphs hold 0.41 GiB):
CONCURRENCY=4,64 PAGODA_ARGS="--max-num-batched-tokens 16384 --max-prefill-graph-tokens 2048" PYTHONPATH=/tmp/site \
  bash bench/online_h2h.sh .h2h/llama3-8b-smoltok $OUT/tuned pagoda
CONCURRENCY=4 PYTHONPATH=/tmp/site bash bench/online_h2h.sh .h2h/llama3-8b-smoltok $OUT/default pagoda
