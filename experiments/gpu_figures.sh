#!/usr/bin/env bash
# The one prepared run for a machine with ONE GPU (JAX with CUDA, flax, optax, orbax and chex
# installed; no internet), from the repository root, in a single call of under 8 minutes:
#
#     bash experiments/gpu_figures.sh            # OUT=out by default
#     OUT=/some/dir bash experiments/gpu_figures.sh
#
# It measures (experiments/gpu_figures.py, whose docstring says what and how): e2e and dp on the
# one GPU for ResNet-18 (CIFAR shape, batch 512) and ViT-B (32x32, patch 4, batch 128) in float32
# and bfloat16, cdp-v2 (simulate, 4 workers) against dp, and the per-stage times behind the
# speedup predictions of the CDP ring and ppll on 4 GPUs. It writes $OUT/gpu_figures.json
# (rewritten after every measurement, so a run cut short keeps what it measured),
# $OUT/gpu_figures.md (the README's table, `gpu_figures.py --table`) and $OUT/gpu_figures.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
# No task starts after 360 s; the one running then has until 440 s; the table takes a second.
timeout 440 python experiments/gpu_figures.py --out "$OUT/gpu_figures.json" --budget 360 "$@" 2>&1 \
  | tee "$OUT/gpu_figures.log"
status=${PIPESTATUS[0]}
if [ -f "$OUT/gpu_figures.json" ]; then
  python experiments/gpu_figures.py --table "$OUT/gpu_figures.json" | tee "$OUT/gpu_figures.md"
fi
exit "$status"
