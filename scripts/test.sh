#!/usr/bin/env bash
# Install the CPU environment if needed, then run the test suite. Extra args go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-venv.sh"
VENV="${SLIME_VENV:-$ROOT/.venv}"
cd "$ROOT"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
exec "$VENV/bin/python" -m pytest -q "$@"
