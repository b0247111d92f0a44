#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv. Idempotent and cheap when
# nothing changed: it reinstalls only when pyproject.toml differs from the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
  .venv/bin/pip install -q --upgrade pip setuptools wheel
fi
stamp=".venv/.kvtether-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi
