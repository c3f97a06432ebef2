#!/usr/bin/env bash
# flash-attn-4 (FlashAttention's CuTe-DSL build, with a Hopper forward) on the lent H100, as a kernel peer.
#
# The GPU machine has no network and each `run` call carries at most 64 MiB, so the wheels travel in
# two parts kept under /root while the machine stays warm (it is given back ~30 s after a call).
#   On this machine, once:  bash bench/fa4_h100.sh prepare          (downloads ~100 MB into .fa4/)
#   Then, back to back:
#     run(carry=[".fa4/p1"], command="bash bench/fa4_h100.sh stage 1")
#     run(carry=[".fa4/p2"], command="bash bench/fa4_h100.sh stage 2 && bash bench/fa4_h100.sh install && \
#         PYTHONPATH=$(bash bench/fa4_h100.sh path):$PWD python3 bench/gpu_check.py kernels")
# The wheels are those of Python 3.12 / CUDA 13 (the machine's torch is 2.11.0+cu130).
set -euo pipefail
FA4=.fa4
PARTS=/root/fa4_parts
SITE=/root/fa4_site
# cutlass sits under the DSL's own folder; a .pth file adds it to sys.path in an install, not under --target.
FA4_PATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
WHEELS="flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"

case "${1:-}" in
  prepare)
    mkdir -p $FA4/dl && rm -rf $FA4/p1 $FA4/p2
    python3 -m pip download -q --no-deps $PLAT -d $FA4/dl $WHEELS
    (cd $FA4/dl && tar cf - *.whl) > $FA4/all.tar
    mkdir -p $FA4/p1 $FA4/p2
    split -b 55M -d -a 1 $FA4/all.tar $FA4/part.
    mv $FA4/part.0 $FA4/p1/ && mv $FA4/part.1 $FA4/p2/ && rm $FA4/all.tar
    sha256sum $FA4/p1/part.0 $FA4/p2/part.1 | sed "s| $FA4/p[12]/| |" > $FA4/p2/SHA256SUMS
    ls -la $FA4/p1 $FA4/p2 ;;
  stage)
    mkdir -p $PARTS && cp $FA4/p$2/part.* $PARTS/
    [ "$2" = 2 ] && cp $FA4/p2/SHA256SUMS $PARTS/
    ls -la $PARTS ;;
  install)
    [ -f $PARTS/part.0 ] || { echo "part 1 is gone (a fresh machine): stage both parts again"; exit 3; }
    (cd $PARTS && sha256sum -c SHA256SUMS) || exit 4
    rm -rf /tmp/fa4_whl && mkdir -p /tmp/fa4_whl && cat $PARTS/part.0 $PARTS/part.1 | tar xf - -C /tmp/fa4_whl
    python3 -m pip install -q --no-deps --no-index --target $SITE /tmp/fa4_whl/*.whl
    PYTHONPATH=$FA4_PATH python3 -c "import flash_attn.cute as f; print('flash_attn.cute', f.__version__)" ;;
  path) echo $FA4_PATH ;;
  *) echo "usage: $0 prepare | stage 1|2 | install | path"; exit 2 ;;
esac
