# Sourced by the device scripts (gpu_check.sh, multi_gpu_check.sh, check_sass.sh): each check stops the
# script with exit status 1 and one line on stderr that says what is missing and how to get it.

# The pycuda wheels carried to the lent GPU machines (which reach no package registry), and how to install them.
CARRIED_WHEELS="install pycuda from the wheels of ../shared/wheels carried as .whl/: python3 -m pip install -q \
--no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:\$PWD (elsewhere: python3 -m pip \
install pycuda)"

# require_commands HOW NAME...: every NAME is a command on PATH.
require_commands() {
  local how=$1 name
  local missing=()
  shift
  for name in "$@"; do
    command -v "$name" >/dev/null 2>&1 || missing+=("$name")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "$(basename "$0"): ${missing[*]} not found on PATH: $how" >&2
    exit 1
  fi
}

# require_modules HOW MODULE...: python3 imports every MODULE.
require_modules() {
  local how=$1 missing
  shift
  missing=$(python3 -c '
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
print(" ".join(missing))' "$@" 2>/dev/null)
  if [ -n "$missing" ]; then
    echo "$(basename "$0"): python3 cannot import $missing: $how" >&2
    exit 1
  fi
}
