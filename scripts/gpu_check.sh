#!/usr/bin/env bash
# The one run on a lent GPU machine: `bash scripts/gpu_check.sh` from the repository root.
# ftrun is not pip-installed there (it asks for torch >= 2.15): it runs from this tree.
# The log goes to $OUT/gpu_check.log ($OUT defaults to /tmp); the exit status is the check's
# (124: the outer 450 s limit struck; gpu_check.py keeps itself within 440 s).
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
timeout --kill-after=10 450 python3 scripts/gpu/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
