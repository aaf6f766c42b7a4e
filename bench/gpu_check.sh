#!/usr/bin/env bash
# The GPU checks, in one go, on a bare CUDA machine with no network (Python with torch+CUDA, no Django).
#
# The site's wheels travel in .whl/ (git-ignored; made on a machine with the package index, see docs/deploy.md
# "A GPU check"), are installed into that Python, and then:
#   1. `muninn-worker probe`: what the client reports of this GPU;
#   2. the worker client's tests, CUDA-only ones included (deterministic CUDA training, two runs bitwise equal);
#   3. bench/gpu_e2e.py: a live stack on the embedded defaults, two `muninn-worker run` processes on the GPU
#      training a resnet18 job, the site's CPU validator re-training challenged segments (honest_gpu_pass);
#   4. bench/gpu_e2e.py again with MUNINN_VALIDATOR_BACKENDS=cpu: the GPU segments checked by GPU peers;
#   5. bench/gpu_reexecution.py on units held out from the tolerances' calibration.
# Logs and JSON go to $OUT (default var/gpu-check). PY=.venv/bin/python SKIP_INSTALL=1 runs it here, on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-var/gpu-check}"
PY="${PY:-python3}"
case "$PY" in /*) ;; */*) PY="$PWD/$PY" ;; esac
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1
if [ -z "${SKIP_INSTALL:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
  "$PY" -m pip install -q --no-index --no-build-isolation --no-deps -e worker_client || exit 1
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  lscpu | grep -m1 'Model name'; nproc
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
} 2>&1 | tee "$OUT/machine.txt"
step() {  # step NAME SECONDS COMMAND...: its log in $OUT/NAME.log, its tail here
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local started=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-4}" "$OUT/$name.log" | cut -c1-1500
  echo "rc=$rc in $((SECONDS - started))s" | tee -a "$OUT/$name.log"
}
PYTHONPATH=worker_client step probe 90 "$PY" -m muninn_worker probe
(cd worker_client && step client-tests 150 "$PY" -m pytest -q -p no:cacheprovider -rs tests)
TAIL=16 step e2e-validator 240 "$PY" bench/gpu_e2e.py --timeout 200
cp var/gpu_e2e/log/celery-worker.log "$OUT/e2e-celery.log" 2>/dev/null
TAIL=12 step e2e-peers 200 "$PY" bench/gpu_e2e.py --validator-backends cpu --rounds 2 --timeout 160
TAIL=12 step reexecution 200 "$PY" bench/gpu_reexecution.py --units 6 --first-unit 36 --segments all \
  --save "$OUT/reexecution.json"
