#!/usr/bin/env bash
# Quick start: tiny GLM-5 RL on the detected accelerator (CPU by default).
# Until the RL loop lands this runs the accelerator smoke check.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-venv.sh"
VENV="${SLIME_VENV:-$ROOT/.venv}"
cd "$ROOT"
exec "$VENV/bin/python" -m slime.accelerator
