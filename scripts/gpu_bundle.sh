#!/usr/bin/env bash
# Builds an offline bundle of what a GPU machine's Python 3.12 lacks to run elastic there
# (ray, pydantic and their few missing dependencies), as one xz tarball small enough to copy
# over a link with a 64 MiB limit. The GPU image used here already has torch (CUDA), cupy,
# typer, rich, fsspec, cloudpickle, matplotlib, scikit-learn, pytest, hypothesis,
# pytest-timeout, transformers, pyarrow, pandas, pillow.
#
# Usage (from the project's root, on the CPU machine):
#   scripts/gpu_bundle.sh [OUT_DIR] (or make gpu-bundle)          # default OUT_DIR: .gpu (add it to .git/info/exclude)
# On the GPU machine, from the project's root:
#   make gpu-check   (scripts/gpu_check.sh unpacks it into a private folder)
# Measured 2026-11-26: ray 2.60.0 cp312 wheel 79 MB; unpacked without ray/jars, ray/rllib and
# ray/cpp and packed with xz: 34 MB, about 2.5 min to pack on 2 cores.
set -euo pipefail
OUT=${1:-.gpu}
PY_VER=${PY_VER:-3.12}
PKGS=${PKGS:-"ray==2.60.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
  jsonschema referencing rpds-py jsonschema-specifications"}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT" "$work/whl" "$work/site"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work/whl" $PKGS
for w in "$work"/whl/*.whl; do (cd "$work/site" && python3 -m zipfile -e "$w" .); done
rm -rf "$work/site/ray/jars" "$work/site/ray/rllib" "$work/site/ray/cpp"
# zipfile drops the executable bits: scripts/gpu_check.sh restores those of ray/core on unpacking.
tar -C "$work/site" -cJf "$OUT/bundle.tar.xz" .
ls -la "$OUT/bundle.tar.xz"
