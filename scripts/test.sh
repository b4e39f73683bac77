#!/usr/bin/env bash
# Install the CPU environment if needed, then run the test suite. Extra args go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-venv.sh"
VENV="${SLIME_VENV:-$ROOT/.venv}"
cd "$ROOT"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
# Two workers (pytest-xdist) by default, each test file whole on one worker (its module fixtures shared, its order
# kept): the whole-run tests spend much of their time waiting on process start-ups, so a second worker fills the
# cores. SLIME_TEST_WORKERS=0 runs everything in this process.
WORKERS="${SLIME_TEST_WORKERS:-2}"
# -q unless the caller sets the verbosity: `scripts/test.sh -q` adding a second -q would hide pytest's summary line
QUIET=-q
for arg in "$@"; do
  case "$arg" in -q|-qq|--quiet|-v|-vv|--verbose|--verbosity=*) QUIET= ;; esac
done
if [ "$WORKERS" = "0" ]; then
  exec "$VENV/bin/python" -m pytest $QUIET "$@"
fi
# --no-loadscope-reorder: files in collection order (tests/conftest.py puts the whole-run files first), not
# xdist's default of most tests first, which leaves the whole runs, few tests each, for the end.
exec "$VENV/bin/python" -m pytest $QUIET -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
