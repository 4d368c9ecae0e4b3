#!/usr/bin/env bash
# `make gpu-check`: the GPU checks on a machine with a GPU and no network, in minutes.
#   1. the GPU tier (pytest -m gpu), failing if no GPU test ran;
#   2. (inside the tier) fit with 4 workers sharing the GPU through two kills, against a plain
#      single-process GPU reference; real NCCL at world size 1;
#   3. throughput against a plain PyTorch loop (elastic bench gpu; GPU_CHECK_MODELS).
# Ray and pydantic come from an offline bundle when Python lacks them: GPU_BUNDLE (default
# .gpu/bundle.tar.xz, built on a machine with network by `make gpu-bundle`) is unpacked
# into a private folder. Results go to GPU_CHECK_OUT (default gpu-check-out) as they come.
set -u
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-gpu-check-out}; mkdir -p "$OUT"
PY=${PY:-python3}
MODELS=${GPU_CHECK_MODELS:-resnet50,gpt2}
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
if ! version=$($PY -c "import torch, sys; print(torch.__version__); sys.exit(0 if torch.cuda.is_available() else 1)"); then
  echo "gpu-check: torch sees no CUDA device here (torch $version): nothing to check"
  exit 3
fi
if ! $PY -c "import ray, pydantic" 2>/dev/null; then
  BUNDLE=${GPU_BUNDLE:-.gpu/bundle.tar.xz}
  SITE=${GPU_SITE:-/tmp/elastic-gpu-site}
  if [ ! -f "$SITE/.unpacked" ]; then
    [ -f "$BUNDLE" ] || { echo "gpu-check: no ray/pydantic and no bundle at $BUNDLE (scripts/gpu_bundle.sh builds one)"; exit 2; }
    mkdir -p "$SITE" && tar -C "$SITE" -xJf "$BUNDLE" || exit 2
    # Wheels unpacked by zipfile lose their modes: Ray's own executables need theirs back.
    find "$SITE/ray/core" -type f -exec chmod +x {} + && touch "$SITE/.unpacked"
  fi
  export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  $PY -c "import ray, pydantic, torch; print('ray', ray.__version__, 'pydantic', pydantic.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  $PY -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version())" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
status=0
if [ "${GPU_CHECK_PROFILE:-0}" = 1 ]; then
  timeout "${GPU_CHECK_PROFILE_S:-90}" $PY scripts/gpu_profile.py "$OUT" > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"
fi
timeout "${GPU_CHECK_TIER_S:-300}" $PY -m pytest -m gpu tests/gpu -p no:cacheprovider -q -rA \
  -o timeout=120 --junitxml="$OUT/tier.xml" > "$OUT/tier.log" 2>&1
rc=$?
$PY scripts/junit_ran.py "$OUT/tier.xml" > "$OUT/ran.txt" 2>&1; ran_rc=$?
echo "tier rc=$rc, $(head -1 "$OUT/ran.txt")"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tier.log" | tail -15
if [ "$rc" != 0 ] || [ "$ran_rc" != 0 ]; then status=1; fi
timeout "${GPU_CHECK_BENCH_S:-300}" $PY -c "import sys; from elastic.bench.gpu import run; run(sys.argv[1], tuple(sys.argv[2].split(',')), int(sys.argv[3]))" \
  "$OUT" "$MODELS" "${GPU_CHECK_SHARED:-4}" > "$OUT/bench.log" 2>&1
rc=$?; echo "bench rc=$rc"; [ "$rc" = 0 ] || status=1
$PY -m elastic.bench.gpu --table "$OUT/gpu_throughput.json" 2>&1 || true
exit $status
