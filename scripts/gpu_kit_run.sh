#!/usr/bin/env bash
# The GPU kit's one command on the GPU machine (docs/testing.md, "The e2e plan on a borrowed
# GPU machine"). Every device call runs it from the repository root, carrying
# build/gpu-kit/pieces/manifest.json and one piece of `make gpu-kit`:
#   1. stage    the carried piece, checked against the manifest, moves to $GPU_KIT_HOME/pieces
#               (outside the working tree: it stays while the machine is warm); while pieces
#               are missing it says which and exits 0
#   2. unpack   the pieces joined (each piece's and kit.tar.xz's sha256 checked), unpacked,
#               every file checked against the manifest
#   3. install  pip install --no-index --no-deps --target $GPU_KIT_HOME/site: the patched vLLM
#               0.22.1 CUDA wheel and the dependencies the machine lacks, over its torch;
#               byte-compiled once
#   4. run      scripts/gpu_kit_plan.py with the real CUDA handlers, each tiny model in its own
#               process: no connector vs tiering (CPU tier + fs tier) warm, then cold after a
#               restart on the same disk directory, the mamba hybrid in 'all' and 'align'
#               mode, TP=1; per-sample outputs must be identical and the cold arm must load
#               from disk
#   5. report   $OUT/gpu-kit-results.md, one file: the machine, the table, failed arms' logs
# Steps 2-3 are skipped when this manifest's kit is installed already: a rerun on a warm
# machine carries nothing. Arguments go to scripts/gpu_kit_plan.py (run_plan's options, e.g.
# --models gemma3 llama --scenarios base small). Settings: GPU_KIT_HOME (/tmp/gpu-kit),
# GPU_KIT_BUDGET (seconds for the plan, 300), GPU_KIT_PYTHON (python3: the one with torch).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
HOME_DIR=${GPU_KIT_HOME:-/tmp/gpu-kit}
PY=${GPU_KIT_PYTHON:-python3}
BUDGET=${GPU_KIT_BUDGET:-300}
OUT_DIR=${OUT:-$HOME_DIR/out}
T0=$SECONDS
say() { echo "[gpu-kit $((SECONDS - T0)) s] $*"; }
fail() { echo "[gpu-kit] error: $*" >&2; exit 2; }

mkdir -p "$HOME_DIR/pieces" "$OUT_DIR" || fail "cannot create $HOME_DIR or $OUT_DIR"
"$PY" scripts/gpu_kit_pieces.py stage build/gpu-kit/pieces "$HOME_DIR/pieces"
case $? in
  0) ;;
  3) say "staged; the next call carries the next piece (docs/testing.md)"; exit 0 ;;
  *) fail "staging failed (above)" ;;
esac

want=$(sha256sum "$HOME_DIR/pieces/manifest.json" | cut -d' ' -f1)
if [ "$(cat "$HOME_DIR/installed" 2>/dev/null)" != "$want" ]; then
  rm -rf "$HOME_DIR/join" "$HOME_DIR/kit" "$HOME_DIR/site" "$HOME_DIR/installed"
  say "joining the pieces"
  "$PY" scripts/gpu_kit_pieces.py join "$HOME_DIR/pieces" "$HOME_DIR/join" || fail "joining failed (above)"
  say "unpacking kit.tar.xz"
  mkdir -p "$HOME_DIR/kit"
  if command -v xz >/dev/null; then  # multi-threaded where xz can
    xz -T0 -dc "$HOME_DIR/join/kit.tar.xz" | tar -x -C "$HOME_DIR/kit"
  else
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
      "$HOME_DIR/join/kit.tar.xz" "$HOME_DIR/kit"
  fi || fail "unpacking $HOME_DIR/join/kit.tar.xz failed; check the free space under $HOME_DIR"
  rm -rf "$HOME_DIR/join"
  "$PY" scripts/gpu_kit_pieces.py contents "$HOME_DIR/pieces" "$HOME_DIR/kit" || fail "the unpacked kit differs from its manifest (above)"
  say "installing $(find "$HOME_DIR/kit/wheels" -name "*.whl" | wc -l) wheels into $HOME_DIR/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$HOME_DIR/site" "$HOME_DIR"/kit/wheels/*.whl || fail "pip install --target $HOME_DIR/site failed (above)"
  "$PY" -m compileall -q -j 0 "$HOME_DIR/site" >/dev/null  # once, not in each model's process
  echo "$want" > "$HOME_DIR/installed"
fi

export PYTHONPATH=$HOME_DIR/site${PYTHONPATH:+:$PYTHONPATH}
export E2E_MODELS_DIR=$HOME_DIR/kit/models
export PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
RUNS=$HOME_DIR/runs
rm -rf "$RUNS"
say "running the plan (budget ${BUDGET} s): scripts/gpu_kit_plan.py --jobs 8 $*"
timeout $((BUDGET + 120)) "$PY" scripts/gpu_kit_plan.py --jobs 8 --budget "$BUDGET" --out "$RUNS" "$@"
rc=$?
RESULTS=$OUT_DIR/gpu-kit-results.md
{
  echo "# The e2e plan from the GPU kit, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "- machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  echo "- $("$PY" -c 'import platform, torch, importlib.metadata as m; v = m.version
print("python", platform.python_version(), "torch", torch.__version__,
      "transformers", v("transformers"), "vllm", v("vllm"))' 2>&1 | tail -1)"
  echo "- kit manifest sha256 $want; scripts/gpu_kit_plan.py $*; exit $rc after $((SECONDS - T0)) s"
  echo
  cat "$RUNS/results.md" 2>/dev/null || echo "No results.md: the plan stopped before writing its table (exit $rc); the call's output has the driver's messages."
} > "$RESULTS"
say "results: $RESULTS (exit $rc)"
exit $rc
