# Images of SpotRL. Targets:
#   operator     slim Python, the Kopf operator only (no torch)
#   runtime-cpu  slim Python, torch and vLLM's CPU build: CPU jobs and the kind end-to-end tests
#   runtime      CUDA base, torch + vLLM: the controller and generation workers on GPUs
# All run as the non-root user 10001. Dependencies are installed with the pinned set in
# constraints.txt (and overrides.txt), so an image resolves the same versions as CI. Build with BuildKit
# (DOCKER_BUILDKIT=1): a cache mount keeps uv's wheel downloads between builds, so a
# rebuild after a code change neither fetches nor reinstalls torch.
#
# The bases are build arguments. Where no registry is reachable, e2e/kind/base-image.sh
# builds local stand-ins (a debootstrap bookworm, uv from PyPI) and e2e/kind/images.sh
# passes them in.
ARG PYTHON_BASE=python:3.11-slim
ARG CUDA_BASE=nvidia/cuda:13.0.1-base-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

# ---------------------------------------------------------------- common layers
FROM ${PYTHON_BASE} AS python-base
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_CACHE_DIR=/var/cache/uv UV_PYTHON_DOWNLOADS=never \
    VIRTUAL_ENV=/opt/spotrl PATH=/opt/spotrl/bin:$PATH \
    HOME=/home/spotrl SPOTRL_CACHE=/home/spotrl/.cache/spotrl
RUN useradd --uid 10001 --create-home --home-dir /home/spotrl --shell /usr/sbin/nologin spotrl \
 && uv venv --python python3 /opt/spotrl
WORKDIR /src
COPY pyproject.toml constraints.txt overrides.txt ./

# ---------------------------------------------------------------- operator
FROM python-base AS operator
# Dependencies first (from pyproject.toml alone), then our code: a code change rebuilds
# only the last two layers.
RUN --mount=type=cache,target=/var/cache/uv,id=spotrl-uv \
    uv pip install -c constraints.txt -r pyproject.toml --extra operator
COPY README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN uv pip install --no-cache --no-deps . && rm -rf /src/build
USER 10001
WORKDIR /home/spotrl
ENTRYPOINT ["spotrl", "operator"]

# ---------------------------------------------------------------- runtime-cpu
FROM python-base AS runtime-cpu
# vLLM's CPU build links libnuma (its C extension does not load without it).
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libnuma1 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
# Without triton (640 MB): torch's GPU kernel compiler, which nothing on a CPU runs (torch
# imports it only when present), and a ninth of what kind's nodes load. Without the CUDA
# libraries that torch opens only when a GPU kernel asks for them (cuDNN's engines,
# cuSOLVER, NVRTC, the profilers' perf libraries, static archives: 964 MB): `import torch`
# needs only those its own libraries link against. The check after the rm fails the build
# should a torch release link one of them, instead of a CPU job failing at its first import.
# vLLM's CPU build (extra cpu) adds 1.26 GB; without OpenCV (multimodal video only), numba and
# llvmlite (n-gram speculative decoding only), 0.92 GB. Its engine starts, reloads weights and
# generates without them (and the import check below fails the build should that change). The
# check loads vLLM's kernels as its engine does (import_kernels picks _C, _C_AVX512 or _C_AVX2 by
# the CPU): `import vllm._C` itself needs AVX-512 BF16 and dies with SIGILL on an AVX2 machine.
RUN --mount=type=cache,target=/var/cache/uv,id=spotrl-uv \
    uv pip install -c constraints.txt --override overrides.txt -r pyproject.toml --extra operator --extra runtime \
      --extra cpu \
 && uv pip uninstall triton opencv-python-headless numba llvmlite \
 && cd /opt/spotrl/lib/python3.*/site-packages/nvidia \
 && rm cudnn/lib/libcudnn_adv.so.9 cudnn/lib/libcudnn_cnn.so.9 cudnn/lib/libcudnn_graph.so.9 \
       cudnn/lib/libcudnn_engines_precompiled.so.9 cudnn/lib/libcudnn_engines_runtime_compiled.so.9 \
       cudnn/lib/libcudnn_heuristic.so.9 cudnn/lib/libcudnn_ops.so.9 \
       cu13/lib/libcusolver.so.12 cu13/lib/libcusolverMg.so.12 cu13/lib/libnvrtc.so.13 cu13/lib/libnvrtc.alt.so.13 \
       cu13/lib/libnvrtc-builtins.so.13.0 cu13/lib/libnvrtc-builtins.alt.so.13.0 cu13/lib/libnvperf_host.so \
       cu13/lib/libnvperf_target.so cu13/lib/libpcsamplingutil.so cu13/lib/libcudadevrt.a cu13/lib/libcudart_static.a \
       cu13/lib/libnvblas.so.13 cu13/lib/libcufftw.so.12 cu13/lib/libcheckpoint.so \
 && cd / && python -c "import torch, torch.distributed.checkpoint, transformers; \
from torch.distributed.fsdp import fully_shard; m = torch.nn.Linear(4, 4); \
torch.optim.AdamW(m.parameters()).step(); torch.linalg.inv(torch.eye(3) + 1); torch.fft.fft(torch.ones(4)); \
from vllm.platforms import current_platform; current_platform.import_kernels(); \
assert hasattr(torch.ops._C, 'rms_norm'), 'vLLM CPU kernels did not load'; \
import vllm.entrypoints.llm, vllm.v1.engine.core, vllm.v1.worker.cpu_worker, vllm.v1.worker.cpu_model_runner"
COPY README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN uv pip install --no-cache --no-deps . && rm -rf /src/build
# The demo policy, built now rather than by every fresh controller (models/prebuild.py).
RUN python -m spotrl_runtime.models.prebuild /usr/share/spotrl/models && chmod -R a+rX /usr/share/spotrl
ENV SPOTRL_PREBUILT_MODELS=/usr/share/spotrl/models
USER 10001
WORKDIR /home/spotrl
ENTRYPOINT ["spotrl"]

# ---------------------------------------------------------------- runtime (GPU)
# torch 2.11's wheels carry their CUDA 13 user-space libraries; the base adds the
# container toolkit's expectations. The node needs an NVIDIA driver that supports CUDA 13.
# uv downloads Python 3.11 when the base has none (the CUDA base has Ubuntu's 3.12).
FROM ${CUDA_BASE} AS runtime
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_CACHE_DIR=/var/cache/uv UV_PYTHON_INSTALL_DIR=/opt/python \
    VIRTUAL_ENV=/opt/spotrl PATH=/opt/spotrl/bin:$PATH \
    HOME=/home/spotrl SPOTRL_CACHE=/home/spotrl/.cache/spotrl
RUN useradd --uid 10001 --create-home --home-dir /home/spotrl --shell /usr/sbin/nologin spotrl \
 && uv venv --python 3.11 /opt/spotrl
WORKDIR /src
COPY pyproject.toml constraints.txt overrides.txt ./
RUN --mount=type=cache,target=/var/cache/uv,id=spotrl-uv \
    uv pip install -c constraints.txt --override overrides.txt -r pyproject.toml --extra operator --extra runtime \
      --extra gpu
COPY README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN uv pip install --no-cache --no-deps . && rm -rf /src/build
# The demo policy, built now rather than by every fresh controller (models/prebuild.py).
RUN python -m spotrl_runtime.models.prebuild /usr/share/spotrl/models && chmod -R a+rX /usr/share/spotrl
ENV SPOTRL_PREBUILT_MODELS=/usr/share/spotrl/models
USER 10001
WORKDIR /home/spotrl
ENTRYPOINT ["spotrl"]
