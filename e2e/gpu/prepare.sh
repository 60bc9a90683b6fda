#!/usr/bin/env bash
# Fills .gpu/ (ignored by git) with what the GPU machine lacks, for e2e/gpu/check.sh: the
# machine has CUDA, torch 2.11 and transformers but no network, and takes at most 64 MiB
# of files per call. Ray's wheel alone is 76 MiB, so it travels as a trimmed tarball
# (no Java jars, RLlib, Data, Serve, Tune, Train, LLM or dashboard web build).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .gpu && mkdir -p .gpu /tmp/spotrl-gpu-dl
py=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
pip=(python3 -m pip download -q "${py[@]}" -d /tmp/spotrl-gpu-dl)
"${pip[@]}" ray==2.60.0
"${pip[@]}" -c constraints.txt pydantic pydantic-core annotated-types typing-inspection torchdata \
  jsonschema jsonschema-specifications referencing rpds-py
stage=$(mktemp -d)
(cd "$stage" && python3 - /tmp/spotrl-gpu-dl/ray-2.60.0-*.whl <<'PY' &&
import os, sys, zipfile
# Unzip keeping the executable bits (raylet, gcs_server): `python -m zipfile` drops them.
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info)
        mode = (info.external_attr >> 16) & 0o777
        if mode:
            os.chmod(path, mode)
PY
  rm -rf ray/jars ray/rllib ray/data ray/serve ray/tune ray/train ray/llm ray/dashboard/client/build &&
  tar -cJf "$OLDPWD/.gpu/ray-trim.tar.xz" ray ray-2.60.0.dist-info)
rm -rf "$stage"
find /tmp/spotrl-gpu-dl -name '*.whl' ! -name 'ray-*' -exec cp {} .gpu/ \;
du -sh .gpu; ls .gpu
