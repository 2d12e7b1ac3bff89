#!/usr/bin/env bash
# The one prepared run for a machine with ONE GPU (JAX with CUDA, flax, optax, orbax and chex
# installed; no internet), from the repository root, in a single call of under 8 minutes:
#
#     bash experiments/gpu_figures.sh            # OUT=out by default
#     OUT=/some/dir bash experiments/gpu_figures.sh
#     bash experiments/gpu_figures.sh --tiny     # the CPU smoke test (tests/test_gpu_figures.py)
#
# It measures (experiments/gpu_figures.py, whose docstring says what and how): e2e and dp on the
# one GPU for ResNet-18 (CIFAR shape, batch 512) and ViT-B (32x32, patch 4, batch 128) in float32
# and bfloat16, cdp-v2 (simulate, 4 workers) against dp, and the per-stage times behind the
# speedup predictions of the CDP ring and ppll on 4 GPUs, and gpipe on every GPU of the machine (a
# (stage, data) mesh: 8, 12, 16... GPUs) with its input-wait fraction, and `cdpjax plan`'s top 3 on
# the one GPU, each benched (predicted step and memory beside measured). It writes $OUT/gpu_figures.json
# (rewritten after every measurement, so a run cut short keeps what it measured),
# $OUT/gpu_figures.md (docs/measured.md's GPU table, `gpu_figures.py --table`) and $OUT/gpu_figures.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"  # PYTHON=...: another interpreter
# Besides JAX, flax, optax, orbax and chex, cdpjax needs ml_collections here (pure Python; what it
# needs, absl-py and PyYAML, comes with orbax); tensorflow-datasets, PIL, scikit-learn, matplotlib
# and tqdm are not needed. With no internet on the GPU machine, a wheel in wheels/ is used as it is
# (a zip on PYTHONPATH): `pip download ml_collections --no-deps -d wheels` where there is internet,
# and wheels/ travels with the working tree.
if ! "$PY" -c "import ml_collections" 2>/dev/null; then
  for wheel in wheels/ml_collections-*.whl; do
    if [ -f "$wheel" ]; then PYTHONPATH="$wheel:$PYTHONPATH"; fi
  done
fi
if ! "$PY" -c "import cdpjax.bench, cdpjax.train" 2>"$OUT/gpu_figures.log"; then
  echo "gpu_figures: cdpjax does not import here: $(tail -n 1 "$OUT/gpu_figures.log") (see the comment above)" >&2
  exit 2
fi
# No task starts after 360 s; the one running then has until 440 s; the table takes a second.
timeout 440 "$PY" experiments/gpu_figures.py --out "$OUT/gpu_figures.json" --budget 360 "$@" 2>&1 \
  | tee -a "$OUT/gpu_figures.log"
status=${PIPESTATUS[0]}
if [ -f "$OUT/gpu_figures.json" ]; then
  "$PY" experiments/gpu_figures.py --table "$OUT/gpu_figures.json" | tee "$OUT/gpu_figures.md"
fi
exit "$status"
