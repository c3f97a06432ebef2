# Device call 1 (after `vllm_h100.sh stage 1`, `stage 2 && install`; pagoda's server wheels to /tmp/site):
CONCURRENCY=1,4,16 PYTHONPATH=/root/vb_site:/tmp/site bash bench/online_h2h.sh .h2h/llama3-8b-smoltok $OUT/h2h pagoda vllm
# Device call 2, a later machine (c64-both/):
CONCURRENCY=64,1 PYTHONPATH=/root/vb_site:/tmp/site bash bench/online_h2h.sh .h2h/llama3-8b-smoltok $OUT/h2h pagoda vllm
# then on the same machine, pagoda alone: without (c64-pagoda-no-graphs/) and with (c64-pagoda-graphs/) the piecewise prompt graphs
CONCURRENCY=64 PAGODA_ARGS="--max-prefill-graph-tokens 0" PYTHONPATH=/root/vb_site:/tmp/site bash bench/online_h2h.sh .h2h/llama3-8b-smoltok $OUT/a pagoda
CONCURRENCY=64 PYTHONPATH=/root/vb_site:/tmp/site bash bench/online_h2h.sh .h2h/llama3-8b-smoltok $OUT/b pagoda
# Device call 3 (c4-prefill-graph-tokens/), pagoda alone at 4 users, 8 prompts each, alternating 1024 and 2048
# (the fourth run's files did not come back: the device returns a limited number of files):
for pgt in 1024 2048 1024 2048; do d=$OUT/p$pgt-$RANDOM; mkdir -p $d; CONCURRENCY=4 PROMPTS_PER_USER=8 \
  PAGODA_ARGS="--max-prefill-graph-tokens $pgt" PYTHONPATH=/root/vb_site:/tmp/site bash bench/online_h2h.sh .h2h/llama3-8b-smoltok $d pagoda; done
