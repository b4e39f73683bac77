# Which machine this is and which torch a Python environment already has; sourced by scripts/setup-venv.sh
# (and tests/test_setup_machine.py, which fakes the machine). Installs nothing.
#
#   slime_detect_machine          -> cuda | npu | cpu   (an NVIDIA driver, an Ascend driver/CANN, neither)
#   slime_constraints_for KIND    -> constraints/KIND.txt of the repository
#   slime_torch_build PYTHON      -> "cuda VERSION" | "npu VERSION" | "cpu VERSION" | "" (no torch)
#
# SLIME_MACHINE=cpu|cuda|npu overrides the detection; ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME (set by CANN's
# set_env.sh) or SLIME_ASCEND_ROOT (default /usr/local/Ascend) say where CANN is looked for.

SLIME_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

slime_cann_set_env() {
  # CANN's set_env.sh, the file the NPU images source; empty when none is installed
  local root="${SLIME_ASCEND_ROOT:-/usr/local/Ascend}" f
  for f in "${ASCEND_TOOLKIT_HOME:-}/set_env.sh" "${ASCEND_HOME_PATH:-}/set_env.sh" \
           "$root/ascend-toolkit/set_env.sh" "$root/cann/set_env.sh"; do
    if [ -f "$f" ] && [ "$f" != "/set_env.sh" ]; then
      echo "$f"
      return 0
    fi
  done
  return 0
}

slime_detect_machine() {
  if [ -n "${SLIME_MACHINE:-}" ]; then
    case "$SLIME_MACHINE" in cpu|cuda|npu) echo "$SLIME_MACHINE"; return 0 ;; esac
    echo "SLIME_MACHINE=$SLIME_MACHINE: use cpu, cuda or npu" >&2
    return 2
  fi
  # nvidia-smi comes with the NVIDIA driver; a CUDA toolkit alone (no driver) cannot run a CUDA torch
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo cuda
  elif [ -n "$(slime_cann_set_env)" ] || command -v npu-smi >/dev/null 2>&1; then
    echo npu
  else
    echo cpu
  fi
}

slime_constraints_for() {
  echo "$SLIME_REPO_ROOT/constraints/$1.txt"
}

slime_torch_build() {
  # From the installed distributions' metadata only: importing torch would load torch_npu's autoload (which
  # fails without CANN) and takes seconds. A "+cu"/"+rocm" local version is a GPU build; torch_npu beside
  # torch makes it the NPU stack.
  local py="$1"
  [ -x "$py" ] || return 0
  "$py" - <<'PY' 2>/dev/null || true
import importlib.metadata as m
try:
    v = m.version("torch")
except m.PackageNotFoundError:
    raise SystemExit(0)
try:
    m.version("torch-npu")
    kind = "npu"
except m.PackageNotFoundError:
    local = v.partition("+")[2]
    kind = "cuda" if local.startswith(("cu", "rocm")) else "cpu"
    if kind == "cpu" and not local:  # PyPI's Linux torch without a label is the CUDA build (nvidia-* wheels)
        try:
            m.version("nvidia-cuda-runtime-cu12")
            kind = "cuda"
        except m.PackageNotFoundError:
            try:
                m.version("nvidia-cuda-runtime")
                kind = "cuda"
            except m.PackageNotFoundError:
                pass
print(kind, v)
PY
}
