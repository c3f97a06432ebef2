#!/usr/bin/env bash
# One device call: the CUDA tests, then the gpu_check.py modes named on the command line.
#   bash bench/gpu_check.sh tests faults spec spec-draft spec-draft-graphs spec-draft-ab quant quant-kernels quant-sweep quant-gemv quant-gemv-tests quant-gemv-sweep quant-mid-tests fp8-sweep-w1 fp8-ncu quant-decode quant-w1 ab-w1 ab-w2 ab-decode sweep-ab greedy kernels w1 w2 w1-sync w1-eager w2-eager w1-torch w2-torch transformers roofline fp8kv fp8kv-tests fp8kv-ab long decode-tiles decode-ncu quant-profile verify verify-graphs pdl l2-ab
# Results: $OUT/gpu_check.jsonl (JSON lines) and $OUT/pytest-cuda*.log (OUT defaults to /tmp/gpu_check);
# committed under bench/results/ as YYYY-MM-DD-<device>-<commit>-<what> (gpu-check.jsonl, pytest-cuda.log).
set -u
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
# The device image lacks pagoda's pure-Python test dependencies (gguf, which the default model's loader imports,
# jsonschema): carried as `.whl/dev`, they go into a site of their own (without it the default-model tests
# error in their fixtures with "No module named 'gguf'", and the speculative-decoding ones do not collect). Here,
# ~0.7 MB: pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#   --platform manylinux_2_17_x86_64 -d .whl/dev gguf jsonschema jsonschema-specifications referencing rpds-py attrs
if [ -d .whl/dev ] && ! python3 -c "import gguf" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --target /root/dev_site .whl/dev/*.whl && export PYTHONPATH=$PYTHONPATH:/root/dev_site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_kernels_small.py \
             tests/test_cuda.py tests/test_greedy_equality.py -k "cuda or kernel or triton" 2>&1 | tee $OUT/pytest-cuda.log | tail -5 ;;
    faults) python3 -m pytest -q -p no:cacheprovider tests/test_engine_faults.py -k cuda 2>&1 \
             | tee $OUT/pytest-cuda-faults.log | tail -5 ;;
    spec) python3 -m pytest -q -p no:cacheprovider tests/test_spec_decode.py -k "cuda or async_steps" 2>&1 \
             | tee $OUT/pytest-cuda-spec.log | tail -5 ;;
    # Draft-model speculation on the GPU: its CUDA tests, then the default model drafting for itself (every
    # greedy draft token accepted) at batch 1, with the cost model and with the full k every step.
    spec-draft) python3 -m pytest -q -p no:cacheprovider tests/test_spec_draft.py -k "cuda" 2>&1 \
             | tee $OUT/pytest-cuda-spec-draft.log | tail -5
           draft=$(python3 -c "from engine.default_model import default_model_dir as d; print(d())")
           python3 -m bench.spec_decode --device cuda --draft $draft --k 4 --out $OUT/spec-draft.jsonl 2>&1 | tail -1
           python3 -m bench.spec_decode --device cuda --draft $draft --k 4 --full-k --out $OUT/spec-draft.jsonl 2>&1 | tail -1 ;;
    # The draft model's CUDA tests alone (decode graphs equal eager and no speculation, no capture or compile
    # after start-up, the memory profile covering the draft): a few minutes.
    spec-draft-graphs) python3 -m pytest -q -p no:cacheprovider tests/test_spec_draft.py -k cuda 2>&1 \
             | tee $OUT/pytest-cuda-spec-draft-graphs.log | tail -5 ;;
    # The default model drafting for itself with the full k, its draft decode on graphs then eager: the cost
    # ratio c and tok/s of each (summary lines in $OUT/spec-draft-ab.jsonl).
    spec-draft-ab) draft=$(python3 -c "from engine.default_model import default_model_dir as d; print(d())")
           for eager in "" --enforce-eager; do
             python3 -m bench.spec_decode --device cuda --draft $draft --k 4 --full-k --passages 2 $eager \
               --out $OUT/spec-draft-ab.jsonl 2>&1 | tail -1 | cut -c1-600
           done ;;
    # Issue 22's H100 speed table, in two calls of under 10 minutes: `quant-kernels` (kernel tests, per-layer
    # times, the tile sweeps), then `quant-decode quant-w1` (Llama-3-8B decode at batch 1/16/64
    # for bf16, W8A16, W4A16 g128 GPTQ layout, FP8, W8A8 with dummy weights, one process per kind; W1 in bf16
    # and with --quantization fp8).
    # quant-kernels: the CUDA quant kernel tests, per-layer times, then the tile sweeps (decode GEMV first, then
    # the activation quantizer and the int8 GEMM), all cut at 8 minutes from the step's start (results so far
    # are printed and in $OUT/quant-gpu.jsonl); quant-sweep the sweeps alone, cut likewise (QUANT_SWEEP="gemv"
    # or "w8a8": one of them; "mid": the decode tl.dot kernel at 16 and 64 rows; "w8a8" the W8A8 8-bit GEMM
    # (split K, unfused and fused, CUDA-graph timed beside quantize_rows + torch._scaled_mm / _int_mm) at 1, 16
    # and 64 rows, QUANT_W8A8_KINDS "fp8 int8" by default, fp8 first; mid and w8a8 stop their candidates at
    # their own budget, QUANT_BUDGET seconds, 360 by default, and print the per-layer totals per rows).
    # Compact lines: shape, best tiles, us, GB/s beside the alternatives, and the entries for
    # engine/kernels/quant_tiles.py.
    quant-kernels) start=$SECONDS
           timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_quant.py \
             -k "cuda or kernel or gemv or quantize_rows or scaled_matmul" 2>&1 | tee $OUT/pytest-cuda-quant.log | tail -3
           timeout $((480 - (SECONDS - start))) python3 -m bench.quant_gpu --batch 1 16 64 --sweep \
             --out $OUT/quant-gpu.jsonl 2>&1 | tail -90 ;;
    quant-sweep) timeout 480 python3 -m bench.quant_gpu --no-layers --sweep ${QUANT_SWEEP:-} --budget ${QUANT_BUDGET:-360} \
             --w8a8-kinds ${QUANT_W8A8_KINDS:-fp8 int8} --out $OUT/quant-gpu.jsonl 2>&1 | tail -90 ;;
    # The batch-1 decode GEMV (issue 22) in one call of ~9 minutes: its tests on CUDA (quant-gemv-tests: split
    # tiles, each prefetch / stages way, unmasked, float32, activations far from 1, the 8B's deepest layer at tiles
    # of the sweep's grid), its tile sweep alone (quant-gemv-sweep: W4 g128 and W8 per channel at the 8B's four
    # shapes: the table's tiles unpipelined, prefetching 1 / 2 steps and in 3 stages, then candidates, beside bf16
    # and tl.dot; cut at QUANT_BUDGET seconds, 240 by default; prints GEMV_TABLE entries), then Llama-3-8B decode
    # at batch 1, 16 and 64 for bf16, W8A16 and W4A16 g128 with the committed tables, one process per kind.
    quant-gemv|quant-gemv-tests) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_quant.py \
             -k "gemv or exact_in_float32" 2>&1 | tee $OUT/pytest-cuda-gemv.log | tail -2 ;;&
    quant-gemv|quant-gemv-sweep) timeout $((${QUANT_BUDGET:-240} + 90)) python3 -m bench.quant_gpu --no-layers \
             --sweep gemv --budget ${QUANT_BUDGET:-240} --out $OUT/quant-gpu.jsonl 2>&1 | tail -30 ;;&
    quant-gemv-tests|quant-gemv-sweep) ;;
    # The decode tl.dot kernel's CUDA tests (each unpack, the fragment layouts, the 8B's shapes at 4 bits).
    quant-mid-tests) timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_quant.py \
             -k "decode_dot_kernel and (${MID_TESTS:-reference or bf16_on_cuda[4-128]})" 2>&1 \
             | tee $OUT/pytest-cuda-mid.log | tail -3 ;;
    quant-gemv) for kind in bf16 w8a16 w4a16-g128; do
             python3 bench/gpu_check.py quant-decode --kinds $kind 2>&1 | grep -E "RESULT|Error" | cut -c1-400
           done ;;
    # Issue 22's fp8 W1 goal in one call: the W8A8 sweep for fp8 alone at 16 rows (timed at 1 and 16) and 64
    # (the shipped table's tiles timed as "table", then bench.quant_gpu.w8a8_wide_candidates, then the grid),
    # QUANT_BUDGET seconds (240 by default), then W1 once with --quantization fp8 on the shipped tables.
    fp8-sweep-w1) timeout 330 python3 -m bench.quant_gpu --no-layers --sweep w8a8 --budget ${QUANT_BUDGET:-240} \
             --w8a8-kinds fp8 --out $OUT/quant-gpu.jsonl 2>&1 | tail -40
           python3 bench/gpu_check.py workload w1 --backend triton --quantization fp8 2>&1 | grep -E "RESULT|Error" | cut -c1-300 ;;
    # Nsight Compute on the fp8 GEMM alone at 64 rows, the four 8B shapes with the shipped tiles (the second of two
    # passes): DRAM / L2 throughput, occupancy and stalls per shape; the report as $OUT/fp8-ncu.ncu-rep, its
    # details and raw metrics beside it.
    fp8-ncu) ncu=${NCU:-/usr/local/cuda/bin/ncu}
           $ncu -k regex:_scaled_gemm_kernel --launch-skip 4 --launch-count 4 --set full --import-source yes \
             -f -o $OUT/fp8-ncu python3 -m bench.quant_gpu --w8a8-profile 64 2>&1 | tail -6
           $ncu --import $OUT/fp8-ncu.ncu-rep --page details > $OUT/fp8-ncu-details.txt 2>&1
           $ncu --import $OUT/fp8-ncu.ncu-rep --page raw --csv > $OUT/fp8-ncu-raw.csv 2>&1
           grep -E "_scaled_gemm_kernel|Duration|DRAM Throughput|L2 Hit|L1/TEX Hit|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Block Limit (Reg|Shared)|Stall" \
             $OUT/fp8-ncu-details.txt | head -80 ;;
    quant-decode) for kind in bf16 w8a16 w4a16-g128 fp8 w8a8-int8; do
             python3 bench/gpu_check.py quant-decode --kinds $kind 2>&1 | grep -E "RESULT|Error" | cut -c1-400
           done ;;
    quant-w1) for q in "" "--quantization fp8"; do python3 bench/gpu_check.py workload w1 --backend triton $q 2>&1 \
             | grep -E "RESULT|Error" | cut -c1-300; done ;;
    quant) python3 -m pytest -q -p no:cacheprovider tests/test_quant.py -k cuda 2>&1 \
             | tee $OUT/pytest-cuda-quant.log | tail -5
           python3 -m bench.quant_gpu --batch 1 16 64 --out $OUT/quant-gpu.jsonl 2>&1 | tail -25 ;;
    # A/B of the hot path against an earlier tree copied to $AB_BASE (an ignored folder carried with the
    # call: `git archive BASE engine bench | tar -x -C .ab/base`), interleaved base / new, one process each; AB_KV=fp8 for the fp8 KV cache,
    # AB_QUANT=fp8 for --quantization fp8.
    ab-w1|ab-w2) for side in ${AB_ORDER:-base new}; do
             dir=$PWD; [ $side = base ] && dir=$AB_BASE
             (cd $dir && PYTHONPATH=$dir python3 bench/gpu_check.py workload ${step#ab-} --backend triton ${AB_KV:+--kv-cache-dtype $AB_KV} \
                ${AB_QUANT:+--quantization $AB_QUANT} --out $OUT/ab-$side.jsonl 2>&1 | grep -E "RESULT|Error" | cut -c1-200)
           done ;;
    # The Llama-3-8B decode table (quant-decode) for each of AB_KINDS, base / new as ab-w1 interleaves them;
    # AB_BATCHES="1 4 8 16" for other batch sizes (the base's bench/ must know --decode-batches: copy this one in).
    # A sweep's winners against the committed tables on the whole model, in one call: QUANT_SWEEP (gemv, the
    # default, or mid) for QUANT_BUDGET seconds (240), its winners written into a copy of this tree's engine/ and
    # bench/ (.ab/swept, bench.apply_tiles; the table also as $OUT/quant_tiles-swept.py), then ab-decode with
    # that copy as the base: ab-decode-base.jsonl holds the swept tables' rows. AB_KINDS, AB_BATCHES and
    # AB_ORDER as ab-decode's (defaults here: w4a16-g128 w8a16; batches 1 2 for gemv, 16 64 for mid).
    sweep-ab) rm -rf .ab/swept && mkdir -p .ab/swept && cp -r engine bench .ab/swept/
           timeout $((${QUANT_BUDGET:-240} + 120)) python3 -m bench.quant_gpu --no-layers --sweep ${QUANT_SWEEP:-gemv} \
             --budget ${QUANT_BUDGET:-240} --out $OUT/sweep-ab.jsonl 2>&1 | tail -30
           python3 -m bench.apply_tiles $OUT/sweep-ab.jsonl .ab/swept/engine/kernels/quant_tiles.py
           cp .ab/swept/engine/kernels/quant_tiles.py $OUT/quant_tiles-swept.py
           export AB_BASE=$PWD/.ab/swept AB_KINDS=${AB_KINDS:-w4a16-g128 w8a16} \
             AB_BATCHES=${AB_BATCHES:-$([ ${QUANT_SWEEP:-gemv} = mid ] && echo 16 64 || echo 1 2)} ;;&
    # The GEMV prefetching into L2 (GemvTiles.l2_ahead = L2_AHEAD, default 4) at GEMV_TABLE's tiles against
    # the committed table on the whole model: this tree's engine/ and bench/ copied to .ab/l2 with those entries
    # rewritten (bench.apply_tiles --l2-ahead), then ab-decode with that copy as the base: ab-decode-base.jsonl
    # holds the prefetching rows. AB_KINDS, AB_BATCHES and AB_ORDER as ab-decode's (here w4a16-g128, 1 2).
    l2-ab) rm -rf .ab/l2 && mkdir -p .ab/l2 && cp -r engine bench .ab/l2/
           python3 -m bench.apply_tiles --l2-ahead ${L2_AHEAD:-4} .ab/l2/engine/kernels/quant_tiles.py
           export AB_BASE=$PWD/.ab/l2 AB_KINDS=${AB_KINDS:-w4a16-g128} AB_BATCHES=${AB_BATCHES:-1 2} ;;&
    ab-decode|sweep-ab|l2-ab) for side in ${AB_ORDER:-base new}; do
             dir=$PWD; [ $side = base ] && dir=$AB_BASE
             for kind in ${AB_KINDS:-bf16 w4a16-g128 fp8}; do
               (cd $dir && PYTHONPATH=$dir python3 bench/gpu_check.py quant-decode --kinds $kind ${AB_BATCHES:+--decode-batches $AB_BATCHES} \
                  --out $OUT/ab-decode-$side.jsonl 2>&1 | grep -E "RESULT|Error" | cut -c1-240)
             done
           done ;;
    # Programmatic dependent launch and start-up compiles (engine/kernels/pdl.py): the PDL tests, nothing compiled
    # after start-up (eager, graphs, fp8 KV), the Triton backend's greedy equality.
    pdl) timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_pdl.py tests/test_cuda.py \
             tests/test_greedy_equality.py -k "pdl or no_triton_kernel_compiles or triton_backend" 2>&1 \
             | tee $OUT/pytest-cuda-pdl.log | tail -4 ;;
    quicktests) python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_kernels_small.py \
             tests/test_cuda.py tests/test_greedy_equality.py -k "kernel or triton-graphs or triton_backend or pool or prompt_step" \
             2>&1 | tee $OUT/pytest-cuda-quick.log | tail -5 ;;
    profile-w1|profile-w2) python3 bench/gpu_check.py profile ${step#profile-} ${PROFILE_ARGS:-} 2>&1 | grep -v INFO | head -${PROFILE_LINES:-40}; \
             tail -1 $OUT/gpu_check.jsonl ;;
    timeline-w1|timeline-w2) python3 bench/gpu_check.py timeline ${step#timeline-} ;;
    ttft-pgt*) python3 bench/gpu_check.py ttft --max-prefill-graph-tokens ${step##*-pgt} ;;
    w1-pgt*|w2-pgt*) python3 bench/gpu_check.py workload ${step%%-*} --backend triton --max-prefill-graph-tokens ${step##*-pgt} ;;
    w1|w2) python3 bench/gpu_check.py workload $step --backend triton ;;
    # The fp8 KV cache: fp8kv-tests its CUDA tests; fp8kv those, then W2 and W1 with the bf16 cache and the fp8
    # one, alternating; fp8kv-ab two rounds of W2 and W1, auto then fp8, one process each, no tests.
    fp8kv|fp8kv-tests) python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kv.py \
             "tests/test_cuda.py::test_no_triton_kernel_compiles_after_start_up[fp8]" \
             -k "cuda or reads or store or without_scales or written_back or whole_chunked" 2>&1 \
             | tee $OUT/pytest-cuda-fp8kv.log | tail -5 ;;&
    fp8kv|fp8kv-ab) for round in $(seq $([ $step = fp8kv-ab ] && echo 2 || echo 1)); do
             for w in w2 w1; do for kv in auto fp8; do
               python3 bench/gpu_check.py workload $w --backend triton --kv-cache-dtype $kv 2>&1 | grep -E "RESULT|Error" | cut -c1-400
             done; done
           done ;;
    fp8kv-tests) ;;
    # Batch 64 decode at 8k contexts, Llama-3-8B shape: bf16 vs fp8 KV cache, tok/s and pool size in tokens.
    # One process per dtype: an engine's memory is not all returned to the device when it is deleted.
    long) for kv in auto fp8; do
            python3 bench/gpu_check.py long-decode --backend triton --long-kv $kv 2>&1 | grep -E "RESULT|Error" | cut -c1-600
          done ;;
    # The decode kernel alone for each candidate tiling (DECODE_TILE_CANDIDATES), bf16 and fp8 cache, after the
    # fp8 attention tests on CUDA (the shipped tilings against the torch reference): us, GB/s, best per shape.
    decode-tiles) python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kv.py -k "decode or prefill_reads or widen or tilings" \
             2>&1 | tee $OUT/pytest-cuda-decode-tiles.log | tail -3
           python3 bench/gpu_check.py decode-tiles 2>&1 | grep -E "RESULT|Error|^best" | cut -c1-500 ;;
    # Issue 21: a speculative verify step (k = 4: 5 query tokens a sequence) against a plain decode step, Llama-3-8B
    # shape, batch 1/2/4/8, same engine and sequences (bench/gpu_check.py mode_verify); goal verify <= 1.15x decode.
    verify) python3 bench/gpu_check.py verify 2>&1 | grep -E "RESULT|Error|captured" | cut -c1-800 ;;
    # Verify steps on whole-step CUDA graphs (issue 21): the decode kernel with several queries a sequence (and
    # the decode kernel tests, 16-bit and fp8), greedy equality with graphs / eager / no speculation (n-gram,
    # draft model, the default model), the replay counter, nothing compiled or captured after start-up. The
    # steps `spec` and `spec-draft-graphs` run the other speculation CUDA tests.
    verify-graphs) python3 -m pytest -q -p no:cacheprovider tests/test_verify_graphs.py tests/test_kernels_attention.py \
             tests/test_fp8_kv.py -k "verify or several_queries or test_decode" 2>&1 \
             | tee $OUT/pytest-cuda-verify-graphs.log | tail -8 ;;
    # Nsight Compute on the decode kernel at the W2-like shape: the third fp8 call and the first bf16 one, full set,
    # with SASS-level sampling ($OUT/decode-ncu*.txt / .csv; the report itself as $OUT/decode-ncu.ncu-rep).
    decode-ncu) ncu=${NCU:-/usr/local/cuda/bin/ncu}
           $ncu -k regex:_decode_kernel --launch-skip 2 --launch-count 2 --set full --import-source yes \
             -f -o $OUT/decode-ncu python3 bench/gpu_check.py decode-ncu 2>&1 | tail -4
           $ncu --import $OUT/decode-ncu.ncu-rep --page details > $OUT/decode-ncu-details.txt 2>&1
           $ncu --import $OUT/decode-ncu.ncu-rep --page source --csv --print-source sass > $OUT/decode-ncu-sass.csv 2>&1
           grep -E "_decode_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|L2 Hit|Block Limit" \
             $OUT/decode-ncu-details.txt | head -60 ;;
    # One process per kind: an engine's memory is not all returned to the device when it is deleted.
    quant-profile) for kind in ${QUANT_PROFILE_KINDS:-bf16 fp8}; do python3 bench/gpu_check.py quant-profile --kinds $kind 2>&1 \
             | grep -E "^(---|  )" | cut -c1-150; done ;;
    w1-sync|w2-sync) python3 bench/gpu_check.py workload ${step%-sync} --backend triton --sync ;;
    w1-eager|w2-eager) python3 bench/gpu_check.py workload ${step%-eager} --backend triton --eager ;;
    w1-torch|w2-torch) python3 bench/gpu_check.py workload ${step%-torch} --backend torch --eager ;;
    w1-flash|w2-flash) python3 bench/gpu_check.py workload ${step%-flash} --backend flash_attn ;;
    w1-mnbt*|w2-mnbt*) python3 bench/gpu_check.py workload ${step%%-*} --backend triton --max-num-batched-tokens ${step##*-mnbt} ;;
    *) python3 bench/gpu_check.py $step ;;
  esac
done
