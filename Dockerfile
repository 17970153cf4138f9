# The image scripts/k8s/pytorchjob.yaml and the Slurm container launch in docs/launch.md name:
# CUDA torch, this repository installed with its HuggingFace and TensorBoard extras, and nvcc, so the
# fused csrc kernels build on first use (kernels.backend=auto) on any GPU the toolkit supports.
#   docker build -t REGISTRY/megascale:latest . && docker push REGISTRY/megascale:latest
# Other torch/CUDA pairs: --build-arg TORCH_VERSION=... --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions

# python3 + pip, and ninja for torch's JIT extension builds; ip (iproute2) helps pick NCCL_SOCKET_IFNAME.
# Not pinned: the Ubuntu archive drops superseded versions, so pins break rebuilds; the base tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-dev ninja-build git iproute2 \
    && rm -rf /var/lib/apt/lists/* \
    && ln -sf /usr/bin/python3 /usr/local/bin/python

RUN python -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /workspace/megascale
# Dependencies first (a code change does not re-install them), then the package itself.
COPY pyproject.toml setup.py README.md ./
COPY megascale ./megascale
COPY csrc ./csrc
# The project's own version ranges (pyproject.toml) are the pins here.
# hadolint ignore=DL3013
RUN python -m pip install ".[hf,tensorboard]"
COPY configs ./configs
COPY scripts ./scripts

# Checkpoints and the run directory belong on a mounted volume (the manifests mount /checkpoints).
VOLUME ["/checkpoints"]
CMD ["megascale", "doctor"]
