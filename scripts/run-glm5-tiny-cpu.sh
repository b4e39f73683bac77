#!/usr/bin/env bash
# The quick start's former name (until 6 December 2026 it trained a tiny GLM-5): runs the tiny GLM-5.3-Flash one.
exec bash "$(dirname "${BASH_SOURCE[0]}")/run-glm5.3-flash-tiny-cpu.sh" "$@"
