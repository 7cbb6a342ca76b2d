# One image for every cleave service; docker-compose.yml picks the service by command.
#   CPU:  docker build -t cleave .
#   CUDA: docker build -t cleave --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# CUDA torch wheels bundle the CUDA runtime, so the slim Python base serves GPUs too (the host
# needs the NVIDIA driver and container toolkit).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models \
    CLEAVE_LOG_JSON=true

# Triton builds its driver launcher with the system C compiler the first time a worker starts.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first, from the chosen index, in its own layer: it is most of the image.
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY libs ./libs
COPY services ./services
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" . \
    && useradd --create-home --uid 1000 cleave \
    && mkdir -p /models /var/lib/cleave/kv /run/cleave-secrets \
    && chown cleave /models /var/lib/cleave/kv /run/cleave-secrets \
    && chmod 700 /run/cleave-secrets

USER cleave
EXPOSE 50051 8000
CMD ["cleave", "--help"]
