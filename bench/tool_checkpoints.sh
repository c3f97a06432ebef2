#!/usr/bin/env bash
# The quantized checkpoints the tools themselves write from a model, each tool in a venv of its own (their torch
# and transformers pins differ from pagoda's), all under $PAGODA_CACHE (default ~/.cache/pagoda):
#
#   llmcompressor/  llm-compressor 0.14.0.1, torch 2.13.0, transformers 5.17.0   bench/llmcompressor_checkpoints.py
#   gptqmodel/      GPTQModel 7.7.0, torch 2.14.1, transformers (its pick)        bench/gptqmodel_checkpoints.py
#   autoawq/        AutoAWQ 0.2.9, torch 2.13.0, transformers 4.51.3              bench/autoawq_checkpoints.py
#
#   bash bench/tool_checkpoints.sh MODEL_DIR [llmcompressor gptqmodel autoawq]
#
# A tool whose outputs are complete for the current version of its script is skipped (nothing installed);
# tests/test_quant_tools.py runs this once a session. The venvs stay in $PAGODA_CACHE/tool-venvs/.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
model=$(realpath "$1"); shift
cache=$(realpath -m "${PAGODA_CACHE:-$HOME/.cache/pagoda}")

# The stamp of a tool's outputs: its script, what the scripts share and this file, so that a changed recipe makes them again.
stamp() { cat "bench/$1_checkpoints.py" bench/tool_common.py bench/tool_checkpoints.sh | sha256sum | cut -c1-16; }

venv() {  # name, then one quoted pip argument list per install step
  local dir=$cache/tool-venvs/$1; shift
  if [ ! -f "$dir/.installed" ]; then
    rm -rf "$dir"
    python3 -m venv "$dir"
    for step in "$@"; do
      # shellcheck disable=SC2086  # each step is a word list on purpose
      "$dir/bin/pip" install -q --disable-pip-version-check $step >&2
    done
    touch "$dir/.installed"
  fi
  echo "$dir/bin/python"
}

run_tool() {  # name, python of its venv
  local out=$cache/$1 start=$SECONDS
  echo "== $1: $model -> $out"
  rm -rf "$out"  # made by another version of the recipe, or cut short
  mkdir -p "$out"
  # From the output folder, where GPTQModel leaves its logs/. GPTQModel asks for two loader threads, which a
  # 2-core machine gives it only when told, and torch.compiles its dequantization, minutes of C++ builds on a
  # CPU for a model this small.
  (cd "$out" && PYTHONPATH=$repo GPTQMODEL_CPU_WORKERS=2 TORCH_COMPILE_DISABLE=1 \
    "$2" "$repo/bench/$1_checkpoints.py" "$model" "$out")
  stamp "$1" >"$out/.complete"
  echo "== $1: done in $((SECONDS - start)) s"
}

tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(llmcompressor gptqmodel autoawq)
for t in "${tools[@]}"; do
  if [ -f "$cache/$t/.complete" ] && [ "$(cat "$cache/$t/.complete")" = "$(stamp "$t")" ]; then
    echo "== $t: complete in $cache/$t"
    continue
  fi
  case $t in
    llmcompressor) py=$(venv llmcompressor "torch==2.13.0 transformers==5.17.0 llmcompressor==0.14.0.1") ;;
    gptqmodel) py=$(venv gptqmodel "torch==2.14.1" "gptqmodel==7.7.0 optimum==2.3.0") ;;
    autoawq) py=$(venv autoawq "torch==2.13.0 transformers==4.51.3 accelerate==1.15.0 datasets==5.0.1" "--no-deps autoawq==0.2.9") ;;
    *) echo "unknown tool $t (llmcompressor, gptqmodel, autoawq)" >&2; exit 2 ;;
  esac
  run_tool "$t" "$py"
done
