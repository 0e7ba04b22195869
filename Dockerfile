# embedq worker image (also runs `embedq flower`, `embedq status`, `embedq index`).
#
#   docker build -t embedq:local .
#   docker run --rm --gpus '"device=0"' -e EMBEDQ_BROKER_URL=redis://redis-host:6379/0 embedq:local
#
# The base image brings CUDA, cuDNN and a matching torch build; `pip install` keeps that torch (a
# constraints file pins the installed version, so nothing pulls a second, multi-GB build). Pick another
# base with --build-arg BASE_IMAGE=pytorch/pytorch:<version>-cuda<x.y>-cudnn9-runtime: its CUDA must not
# be newer than what the host's NVIDIA driver supports (`nvidia-smi`, top right).
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/var/cache/embedq/huggingface

WORKDIR /opt/embedq
COPY pyproject.toml README.md ./
COPY embedq ./embedq
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
 && pip install --constraint /tmp/torch-constraint.txt ".[worker,flower,gateway]" \
 && python -c "import torch, embedq; print('embedq', embedq.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)" \
 && rm -rf /tmp/torch-constraint.txt /opt/embedq/build

# A non-root user; its cache directory is the only place the worker writes.
RUN groupadd --system --gid 10001 embedq \
 && useradd --system --uid 10001 --gid embedq --home-dir /var/cache/embedq --shell /usr/sbin/nologin embedq \
 && mkdir -p /var/cache/embedq/huggingface \
 && chown -R embedq:embedq /var/cache/embedq
USER embedq
WORKDIR /var/cache/embedq

# Prometheus endpoints of the worker and its replicas (the first free ports from 9808; docker-compose.yml sets
# EMBEDQ_METRICS_ADDR=0.0.0.0 for Prometheus), Flower's port and the gateway's.
EXPOSE 9808-9811 5555 8080

# SIGTERM (docker stop) makes the worker finish its micro-batch, store what is done and hand the rest of
# its jobs back to the queue within EMBEDQ_SHUTDOWN_TIMEOUT (30 s): give it a longer stop timeout
# (`docker stop -t 60`, compose `stop_grace_period: 60s`).
STOPSIGNAL SIGTERM
ENTRYPOINT ["embedq"]
CMD ["worker"]
