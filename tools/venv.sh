#!/usr/bin/env bash
# Creates or refreshes one of the project's virtualenvs (called by the Makefile):
#   tools/venv.sh DIR PYTHON_VERSION CONSTRAINTS EXTRAS
#   e.g. tools/venv.sh .venv 3.12 constraints/py312-jax012.txt dev
#   tools/venv.sh --find 3.12     (prints the interpreter it would use)
# - Python X.Y: $PYTHON if set, else `pythonX.Y` on PATH if it runs (a pyenv shim for a
#   version pyenv has not selected does not), else the newest $(pyenv root)/versions/X.Y.*.
#   None: one line saying what is needed, exit 1.
# - DIR made by another Python (another X.Y, or an interpreter that is gone) is rebuilt.
# - `pip install -c CONSTRAINTS -e .[EXTRAS]` runs when pyproject.toml, CONSTRAINTS, EXTRAS
#   or the interpreter changed since the last install (DIR/.installed records them).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$1" = --find ]; then
  dir="this" want=$2
else
  dir=$1 want=$2 constraints=$3 extras=$4
fi

# Prints the interpreter's real path if it is Python $want, else fails.
is_wanted() {
  "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" \
    2>/dev/null && "$1" -c 'import sys; print(sys.executable)'
}

find_python() {
  if [ -n "${PYTHON:-}" ]; then
    is_wanted "$PYTHON" || { echo "error: PYTHON=$PYTHON is not a working Python $want" >&2; return 1; }
    return
  fi
  local root candidate
  root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
  for candidate in "python$want" $(ls -d "$root"/versions/"$want".*/bin/python"$want" 2>/dev/null | sort -rV); do
    is_wanted "$candidate" && return
  done
  echo "error: $dir needs Python $want: no working python$want on PATH nor in $root/versions/$want.*" \
       "(install it, e.g. \`pyenv install $want\`, or run make with PYTHON=/path/to/python$want)" >&2
  return 1
}

if [ "$1" = --find ]; then
  find_python
  exit
fi

if ! { [ -x "$dir/bin/python" ] && is_wanted "$dir/bin/python" >/dev/null; }; then
  python=$(find_python)
  if [ -e "$dir" ]; then
    echo "$dir was made by $("$dir/bin/python" --version 2>&1 | head -1 || echo 'a missing Python');" \
         "rebuilding it with Python $want ($python)" >&2
    rm -rf "$dir"
  fi
  "$python" -m venv "$dir"
fi

stamp="$dir/.installed"
state="python $("$dir/bin/python" --version 2>&1) extras [$extras] $(cat pyproject.toml "$constraints" | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$state" ]; then
  "$dir/bin/python" -m pip install --quiet --upgrade pip==26.3
  "$dir/bin/python" -m pip install --quiet -c "$constraints" -e ".[$extras]"
  echo "$state" > "$stamp"
fi
