# syntax=docker/dockerfile:1.7
# Images of SpotRL. Targets:
#   operator     slim Python, the Kopf operator only (no torch)
#   runtime      CUDA base, torch + vLLM: the controller and generation workers on GPUs
#   runtime-cpu  slim Python, torch without vLLM: CPU jobs and the kind end-to-end tests
# All run as the non-root user 10001. Dependencies are installed with the pinned set in
# constraints.txt, so an image resolves the same versions as CI.

ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

# ---------------------------------------------------------------- operator
FROM python:3.11-slim AS operator
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy VIRTUAL_ENV=/opt/spotrl PATH=/opt/spotrl/bin:$PATH
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN uv venv /opt/spotrl && uv pip install --no-cache -c constraints.txt ".[operator]"
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin spotrl
USER 10001
ENTRYPOINT ["spotrl", "operator"]

# ---------------------------------------------------------------- runtime-cpu
FROM python:3.11-slim AS runtime-cpu
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy VIRTUAL_ENV=/opt/spotrl PATH=/opt/spotrl/bin:$PATH \
    HOME=/home/spotrl SPOTRL_CACHE=/home/spotrl/.cache/spotrl
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN uv venv /opt/spotrl && uv pip install --no-cache -c constraints.txt ".[operator,runtime]"
RUN useradd --uid 10001 --create-home --home-dir /home/spotrl --shell /usr/sbin/nologin spotrl
USER 10001
WORKDIR /home/spotrl
ENTRYPOINT ["spotrl"]

# ---------------------------------------------------------------- runtime (GPU)
# torch 2.11's wheels carry their CUDA 13 user-space libraries; the base adds the
# container toolkit's expectations. The node needs an NVIDIA driver that supports CUDA 13.
FROM nvidia/cuda:13.0.1-base-ubuntu24.04 AS runtime
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_INSTALL_DIR=/opt/python \
    VIRTUAL_ENV=/opt/spotrl PATH=/opt/spotrl/bin:$PATH \
    HOME=/home/spotrl SPOTRL_CACHE=/home/spotrl/.cache/spotrl
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN uv venv --python 3.11 /opt/spotrl && uv pip install --no-cache -c constraints.txt ".[operator,runtime,gpu]"
RUN useradd --uid 10001 --create-home --home-dir /home/spotrl --shell /usr/sbin/nologin spotrl
USER 10001
WORKDIR /home/spotrl
ENTRYPOINT ["spotrl"]
