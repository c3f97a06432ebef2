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
# Every run's outputs are checked against the schema (bench/structured.py check_outputs) with jsonschema, which
# neither the GPU image nor vLLM's site may have: XGR_WHEELS may name several directories, e.g.
# XGR_WHEELS=".whl/xgr .whl/dev", one with jsonschema jsonschema-specifications referencing rpds-py attrs (cp312);
# vLLM runs see those after vLLM's own site. Without it the rows say "outputs unchecked" and the summary
# compares nothing.
# After the runs: $OUT/structured_summary.md (bench/structured.py summary: per run kind the out tok/s, tokens
# produced / requested, valid / prefix / invalid outputs, and the ratios only between runs whose outputs are ok).
# A run that fails or times out leaves a row with its error.
set -u
SITE=${VB_SITE:-/root/vb_site}
PAGODA_SITE=$SITE
CHECK_SITE=
if [ -n "${XGR_WHEELS:-}" ]; then
  mkdir -p /tmp/xgr_site /tmp/check_site
  for d in $XGR_WHEELS; do
    for w in "$d"/*.whl; do
      python3 -m zipfile -e "$w" /tmp/xgr_site
      # vLLM's runs get the validator's wheels alone, after its own site (nothing else of these may shadow it).
      case ${w##*/} in jsonschema*|referencing-*|rpds_py-*|attrs-*) python3 -m zipfile -e "$w" /tmp/check_site;; esac
    done
  done
  PAGODA_SITE=/tmp/xgr_site:$SITE CHECK_SITE=/tmp/check_site
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
  path=$PWD:$PAGODA_SITE; [ "$engine" = vllm ] && path=$PWD:$SITE:$CHECK_SITE  # vLLM's own packages first
  PYTHONPATH=$path python3 -c "import jsonschema" 2>/dev/null || echo "NO JSONSCHEMA for $r: its outputs go unchecked"
  PYTHONPATH=$path timeout ${RUN_TIMEOUT:-300} python3 bench/structured.py run $MODEL --engine $engine $flag 2>&1 \
    | grep -v -E 'it/s\]|s/it\]|shutdown' | tail -${LOG_LINES:-4}
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then  # no row of its own: one saying so, so the summary cannot leave the run out unseen
    c=true; [ "$flag" = --plain ] && c=false; g=false; [ "$flag" = --grammar-inline ] && g=true
    echo "{\"workload\": \"w2\", \"engine\": \"$engine\", \"constrained\": $c, \"grammar_inline\": $g, \"error\": \"exit $rc\"}" \
      >> $OUT/structured.jsonl
  fi
done
cat $OUT/structured.jsonl
python3 bench/structured.py summary $OUT/structured.jsonl --md $OUT/structured_summary.md
