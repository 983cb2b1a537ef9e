#!/usr/bin/env bash
# Optional job (not part of .ci/run): ditkit against Raylight's real code on CPU.
#
# Fetches Raylight at the pinned commit (the first with the inner-attention registry ditkit plugs into) and the
# pure-Python pieces its xFuser path needs (xfuser 0.4.5, distvae, yunchang, installed with --no-deps into a cache
# folder, never into the host's venv), then runs the two optional test files:
#   tests/unit/test_raylight_real_dispatcher.py   ditkit's processor behind Raylight's real xFuser Ulysses path and
#                                                 dispatcher (2 gloo ranks; the two CPU workarounds are in the test)
#   tests/integration/test_raylight_example_host.py  the Raylight example workflow against Raylight's real node
#                                                 classes loaded in the ComfyUI host on CPU
# Needs network (GitHub, PyPI). Ray itself is not installed: its actors need GPUs (the tests stand in for it).
#
#   bash tools/raylight_real_check.sh            (PYTHON: the host venv's python by default)
set -euo pipefail

COMMIT=55ea37bbbc1ec241c794269703e62ad937806d7a
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${DITKIT_RAYLIGHT_CACHE:-$HOME/.cache/ditkit/raylight-${COMMIT:0:8}}"
PY="${PYTHON:-$HOME/.cache/ditkit/comfyui-783545f6/venv/bin/python}"

if [[ ! -d "$CACHE/raylight/.git" ]]; then
  git init -q "$CACHE/raylight"
  git -C "$CACHE/raylight" remote add origin https://github.com/komikndr/raylight
fi
if [[ "$(git -C "$CACHE/raylight" rev-parse -q --verify HEAD 2>/dev/null || true)" != "$COMMIT" ]]; then
  git -C "$CACHE/raylight" fetch -q --depth 1 origin "$COMMIT"
  git -C "$CACHE/raylight" checkout -q --detach "$COMMIT"
fi
if [[ ! -d "$CACHE/deps/xfuser" ]]; then
  "$PY" -m pip install -q --target "$CACHE/deps" --no-deps xfuser==0.4.5 distvae==0.1.0 yunchang==0.6.4
fi

cd "$ROOT"
DITKIT_RAYLIGHT_SRC="$CACHE/raylight" DITKIT_RAYLIGHT_DEPS="$CACHE/deps" \
  "$PY" -m pytest -q -p no:cacheprovider -ra tests/unit/test_raylight_real_dispatcher.py \
  tests/integration/test_raylight_example_host.py
