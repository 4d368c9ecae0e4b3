#!/usr/bin/env bash
# A first look at a GPU machine (one H100, Python 3.12, no network): the offline bundle
# installed into /tmp/site, the probe, the GPU tier and the throughput bench, each bounded,
# each writing to $OUT as it goes.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
SITE=/tmp/site; mkdir -p $SITE && tar -C $SITE -xJf .gpu/bundle.tar.xz
export PYTHONPATH=$PWD:$SITE
{ nvidia-smi; nproc; python3 -c "import ray, pydantic, elastic, torch; print(ray.__version__, pydantic.__version__, torch.__version__)"; } > "$OUT/env.txt" 2>&1
echo "env done $(date +%T)"
timeout 60 python3 scripts/gpu_probe.py "$OUT/probe.jsonl" > "$OUT/probe.log" 2>&1; echo "probe rc=$? $(date +%T)"
timeout 160 python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -q -rA -o timeout=60 \
  --junitxml="$OUT/tier.xml" > "$OUT/tier.log" 2>&1; echo "tier rc=$? $(date +%T)"
tail -5 "$OUT/tier.log"
timeout 150 python3 -m elastic.bench.gpu "$OUT" > "$OUT/bench.log" 2>&1; echo "bench rc=$? $(date +%T)"
tail -8 "$OUT/bench.log"
