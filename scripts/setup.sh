#!/usr/bin/env bash
# Create .venv with Python >= 3.12 and install flint-jax (editable) with its test and train extras.
# Idempotent: does nothing when .venv is already up to date with pyproject.toml. Prints the venv's python path.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
stamp="$venv/.flint-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)"

find_python() {
  local c
  for c in python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then  # .python-version says 3.12; ask pyenv directly
    c="$(pyenv which python3.12 2>/dev/null || true)"
    [ -n "$c" ] && { echo "$c"; return 0; }
  fi
  return 1
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  echo "$venv/bin/python"; exit 0
fi
py="$(find_python)" || { echo "flint-jax needs Python >= 3.12 (install it, e.g. 'pyenv install 3.12')" >&2; exit 1; }
echo "setting up $venv with $("$py" --version 2>&1) ..." >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >&2 2>/dev/null || true
"$venv/bin/python" -m pip install -q -e ".[test,train]" >&2
echo "$want" > "$stamp"
echo "$venv/bin/python"
