# syntax=docker/dockerfile:1
#
# pagedserve for a GPU host: one image for all three services (blockmgr, executor, gateway);
# the subcommand picks which. See compose.yaml.
#
#   docker build -t pagedserve .
#   docker run --rm pagedserve --help
#
# Python comes from the official python image; CUDA comes with the torch wheel (its CUDA
# runtime libraries are pip packages); the NVIDIA driver is put into the container by the
# NVIDIA Container Toolkit at run time. The default torch wheel on PyPI for TORCH_VERSION
# 2.13.0 is built for CUDA 13.0 (needs a driver >= 580); for an older driver, build with
# --build-arg TORCH_INDEX_URL=<PyTorch's own wheel index for that CUDA, e.g. its whl/cu128>.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# Triton compiles a small C launcher per kernel signature on first use: it needs a C compiler
# (Python.h ships with this image).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Dependencies first, from pyproject.toml alone, so that editing the source reuses this layer:
# the project's and its `gpu` extra's (triton, for the kernels; the CUDA torch wheel pins the
# triton it was built with, which pip keeps).
WORKDIR /src
COPY pyproject.toml ./
RUN pip install ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} "torch==${TORCH_VERSION}" \
    && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project. The protobuf stubs are build outputs (never committed): generate them into the
# source tree before `pip install .`, so that the installed package carries them.
COPY README.md ./
COPY protos ./protos
COPY pagedserve ./pagedserve
COPY services ./services
RUN python -m pagedserve._protogen \
    && pip install --no-deps . \
    && python -P -c "from pagedserve.v1 import blockmgr_pb2_grpc, executor_pb2_grpc, generation_pb2_grpc; import services.cli, services.common.healthcheck" \
    && pagedserve --help

# Never root at run time. The home directory holds the Triton kernel cache.
RUN groupadd --system --gid 10001 pagedserve \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/pagedserve \
        --shell /usr/sbin/nologin pagedserve
USER 10001:10001
WORKDIR /home/pagedserve
# Models come from a mounted directory (compose.yaml: /models/model); never from a hub.
ENV HF_HOME=/home/pagedserve/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# Conventional ports: gateway gRPC and metrics, block manager, executor.
EXPOSE 50051 9090 50052 50061
ENTRYPOINT ["pagedserve"]
CMD ["--help"]
