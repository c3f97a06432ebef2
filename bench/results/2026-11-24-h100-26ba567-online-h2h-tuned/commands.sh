# H100 calls (nvidia-h100-x1), build 89aff46 (prefill_fresh) copied to .ab/cur (git archive),
# vLLM 0.26.0 staged first on the same warm machine:
#   run(carry=[".peers", ".vllm_whl/p1", ".ab"]) bash .peers/vllm_h100.sh stage 1; (cd .ab/cur && bash bench/gpu_check.sh quicktests)
#   run(carry=[".peers", ".vllm_whl/p2"]) bash .peers/vllm_h100.sh stage 2 && bash .peers/vllm_h100.sh install
# tuned-both/ (the next call, same machine): both servers with a 16,384-token step budget, pagoda also
# piecewise prompt graphs to 2,048 tokens; one after the other, the same sweep.
pip install -q --no-deps --target /tmp/site .whl/*.whl; cd .ab/cur && pip install -q --no-deps --no-build-isolation .
CONCURRENCY=1,4,16,64 PAGODA_ARGS="--max-num-batched-tokens 16384 --max-prefill-graph-tokens 2048" \
  VLLM_ARGS="--max-num-batched-tokens 16384" PYTHONPATH=/root/vb_site:/tmp/site \
  bash bench/online_h2h.sh $R/.h2h/llama3-8b-smoltok $OUT/tuned pagoda vllm
