#!/usr/bin/env bash
# One device call: W2 with a JSON schema on every request, pagoda and vLLM 0.26 in turn, each run in
# its own process, plus both unconstrained. Rows: $OUT/structured.jsonl.
#   bash bench/structured.sh [runs...]   default: pagoda-plain pagoda vllm vllm-plain pagoda pagoda-plain
# (pagoda: under the schema with the grammar thread from 16 rows; pagoda-inline: the grammar work on the engine
# thread, the engine's default)
# The device has no network. vLLM runs need its peer staged and installed first
# (../shared/peers/vllm_h100.sh stage 1; stage 2 && install), whose site (VB_SITE) also gives pagoda
# an xgrammar. With XGR_WHEELS=DIR (carried wheels: xgrammar at the version pyproject pins, and what it
# imports), pagoda runs take xgrammar from those instead; the version is in each row. On a machine without
# vLLM's staged site those must include what the GPU image lacks: apache-tvm-ffi and pydantic (with
# pydantic_core, annotated_types, typing_inspection), e.g. `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 -d .whl/xgr xgrammar==0.2.8 apache-tvm-ffi pydantic ...`.
set -u
SITE=${VB_SITE:-/root/vb_site}
PAGODA_SITE=$SITE
if [ -n "${XGR_WHEELS:-}" ]; then
  mkdir -p /tmp/xgr_site
  for w in "$XGR_WHEELS"/*.whl; do python3 -m zipfile -e "$w" /tmp/xgr_site; done
  PAGODA_SITE=/tmp/xgr_site:$SITE
fi
export PYTHONPATH=$PWD:$PAGODA_SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
export OUT=${OUT:-/tmp/structured}
MODEL=/tmp/structured-model
mkdir -p "$OUT"
python3 -c "import torch; from importlib.metadata import version; print('torch', torch.__version__, 'xgrammar', version('xgrammar'))"
[ -f $MODEL/tokenizer.json ] || python3 bench/structured.py model $MODEL || exit 1
runs=${*:-pagoda-plain pagoda vllm vllm-plain pagoda pagoda-plain}
for r in $runs; do
  engine=${r%-plain}; flag=; [ "$r" != "$engine" ] && flag=--plain
  [ "$r" = pagoda-inline ] && engine=pagoda flag=--grammar-inline  # the grammar work on the engine thread
  echo "=== $r $(date +%T)"
  path=$PWD:$PAGODA_SITE; [ "$engine" = vllm ] && path=$PWD:$SITE  # vLLM with its own site's packages
  PYTHONPATH=$path timeout ${RUN_TIMEOUT:-300} python3 bench/structured.py run $MODEL --engine $engine $flag 2>&1 \
    | grep -v -E 'it/s\]|s/it\]|shutdown' | tail -${LOG_LINES:-4}
done
cat $OUT/structured.jsonl
