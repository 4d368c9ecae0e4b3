#!/usr/bin/env bash
# `make gpu-check`: the GPU checks on a machine with a GPU and no network, in minutes.
#   tier        the GPU tier (pytest -m gpu), failing if no GPU test ran; inside it: fit with 4
#               workers sharing the GPU through two kills against a plain single-process GPU
#               reference, and real NCCL at world size 1 (2 with two GPUs);
#   step        elastic's step at one worker against a plain step on the GPU, time and kernel
#               launches (elastic bench step --device cuda);
#   throughput  elastic against a plain PyTorch loop (elastic bench gpu; GPU_CHECK_MODELS,
#               GPU_CHECK_SHARED workers sharing the GPU);
#   data        on the machine's CPUs: loader processes against max(compute, data/k)
#               (elastic bench data);
#   allreduce   on the machine's CPUs: the allreduce of 4 ranks as 2 hosts
#               (elastic bench allreduce --hosts 2).
# GPU_CHECK_PROFILE=1 first profiles the replica's step beside a plain step in one process
# (scripts/gpu_profile.py: profile.txt, with every wait for the device in a step).
# GPU_CHECK_PARTS picks parts (default: all, in that order). Each part writes its log and
# results into GPU_CHECK_OUT (default: $OUT, else gpu-check-out) as it ends, and a line to
# parts.txt; scripts/gpu_summary.py then prints the table of every part in that folder and
# writes summary.json. Typical: tier 3-4 min, step 0.5, throughput 4, data 1, allreduce 0.5; the
# limits add up to 14. On a machine lent 10 min a call, a call cut short keeps the parts that
# ended: run the others with GPU_CHECK_PARTS into the same folder (or join the two folders'
# parts.txt and results, and run scripts/gpu_summary.py on them: standard library only).
# Ray and pydantic come from an offline bundle when Python lacks them: GPU_BUNDLE (default
# .gpu/bundle.tar.xz, built on a machine with network by `make gpu-bundle`) is unpacked
# into a private folder.
# GPU_CHECK_DEVICE=cpu is the rehearsal, on a machine without a GPU (`make test` runs it): every
# part's own command at a size a CPU runs in seconds (the tier is collected and skipped, the
# benches run on CPU workers), then the summary with `--rehearsal` (the parts ran and wrote
# readable results; no target is judged). A mistake in the check itself then costs nothing of
# a GPU machine's few minutes.
set -u
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-${OUT:-gpu-check-out}}; mkdir -p "$OUT"  # OUT: the device machine's
PY=${PY:-python3}
MODELS=${GPU_CHECK_MODELS:-resnet50,gpt2}; MODELS=${MODELS// /}; MODELS=${MODELS%,}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
if [ "$DEVICE" = cpu ]; then
  echo "gpu-check: a rehearsal on the CPU (GPU_CHECK_DEVICE=cpu): each part at a tiny size, no target judged"
  # ResNet-50 needs torchvision: where it is missing the rehearsal runs GPT-2 alone.
  [ -n "${GPU_CHECK_MODELS:-}" ] || MODELS=$($PY -c "import importlib.util as u; print('resnet50,gpt2' if u.find_spec('torchvision') else 'gpt2')")
elif [ "$DEVICE" != cuda ]; then
  echo "gpu-check: GPU_CHECK_DEVICE is 'cuda' (the default) or 'cpu' (the rehearsal), not '$DEVICE'"
  exit 2
elif ! version=$($PY -c "import torch, sys; print(torch.__version__); sys.exit(0 if torch.cuda.is_available() else 1)"); then
  echo "gpu-check: torch sees no CUDA device here (torch $version): nothing to check"
  echo "(GPU_CHECK_DEVICE=cpu rehearses the check on the CPU)"
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
{ if [ "$DEVICE" = cpu ]; then echo "rehearsal on the CPU ($(uname -m))"; else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi; nproc
  $PY -c "import ray, pydantic, torch; print('ray', ray.__version__, 'pydantic', pydantic.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  $PY -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version())" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
PARTS=${GPU_CHECK_PARTS:-tier,step,throughput,data,allreduce}; PARTS=${PARTS// /}
ELASTIC=($PY -c "import sys; from cli.main import app; sys.argv[0] = 'elastic'; app()")
touch "$OUT/parts.txt"
# part NAME LIMIT_S RESULT COMMAND...: runs the command if NAME is in PARTS, its output in
# NAME.log; its old RESULT file and parts.txt line go first (a part run again replaces them,
# so that the check can run in several calls into one folder and one summary).
part() {
  local name=$1 limit=$2 result=$3 started rc; shift 3
  case ",$PARTS," in *",$name,"*) ;; *) return 0 ;; esac
  rm -f "$OUT/$result"; grep -v "^$name " "$OUT/parts.txt" > "$OUT/parts.tmp"; mv "$OUT/parts.tmp" "$OUT/parts.txt"
  started=$(date +%s)
  timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  echo "$name $rc $(( $(date +%s) - started ))" >> "$OUT/parts.txt"
  echo "$name rc=$rc ($(( $(date +%s) - started )) s)"
  [ "$rc" = 0 ] || tail -n 25 "$OUT/$name.log"
}
if [ "${GPU_CHECK_PROFILE:-0}" = 1 ]; then  # the replica's step in one process (profile.txt)
  if [ "$DEVICE" = cpu ]; then PROFILE=("${MODELS%%,*}" cpu tiny); else PROFILE=(resnet50 cuda full); fi
  timeout "${GPU_CHECK_PROFILE_S:-90}" $PY scripts/gpu_profile.py "$OUT" "${PROFILE[@]}" > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"
fi
if [ "$DEVICE" = cpu ]; then  # the rehearsal's sizes: seconds each on two cores
  TIER_CHECK=true; STEP=(--depths 2,4 --width 8 --batch 8 --image-size 8 --steps 3)
  BENCH=(--size tiny --shared 2); DATA=(--loader-workers 1 --steps 9 --batch 16 --image-size 24)
  SIZES=4KB,64KB; SUMMARY=(--rehearsal)
else
  TIER_CHECK=$PY; STEP=(--depths 16,52 --width 64 --batch 32 --image-size 32 --steps 30)
  BENCH=(--shared "${GPU_CHECK_SHARED:-4}"); DATA=(--loader-workers 2 --steps 30); SIZES=1MB,16MB
  SUMMARY=()
fi
part tier "${GPU_CHECK_TIER_S:-300}" tier.xml bash -c '$0 -m pytest -m gpu tests/gpu -p no:cacheprovider -q -rA \
  -o timeout=120 --junitxml="$1/tier.xml" && $2 scripts/junit_ran.py "$1/tier.xml"' "$PY" "$OUT" "$TIER_CHECK"
part step "${GPU_CHECK_STEP_S:-60}" step.json "${ELASTIC[@]}" bench step --device "$DEVICE" "${STEP[@]}" \
  --json "$OUT/step.json"
part throughput "${GPU_CHECK_BENCH_S:-270}" gpu_throughput.json "${ELASTIC[@]}" bench gpu \
  --models "$MODELS" --device "$DEVICE" "${BENCH[@]}" --out-dir "$OUT"
part data "${GPU_CHECK_DATA_S:-120}" data.json "${ELASTIC[@]}" bench data --workers 2 "${DATA[@]}" \
  --rounds 1 --json "$OUT/data.json"
part allreduce "${GPU_CHECK_ALLREDUCE_S:-90}" allreduce.json "${ELASTIC[@]}" bench allreduce --world-size 4 \
  --hosts 2 --sizes "$SIZES" --json "$OUT/allreduce.json"
$PY scripts/gpu_summary.py "$OUT" ${SUMMARY[@]+"${SUMMARY[@]}"}
