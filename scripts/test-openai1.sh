#!/usr/bin/env bash
# Runs the SDK tests against the latest openai 1.x (httpx-based), next to the main .venv that has
# the latest 3.x (httpx2-based): the SDK promises openai>=1.99,<4 and hooks private client methods,
# so both majors must pass. Builds .venv-openai1 on first use; cheap afterwards.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
venv=.venv-openai1
stamp="$venv/.kvtether-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip setuptools wheel
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/pip" install -q -e '.[dev]'
  # openai-agents (dev extra) needs openai>=3: it leaves this environment, where its SDK tests skip.
  "$venv/bin/pip" uninstall -q -y openai-agents
  # Second step on purpose: the project pins openai>=1.99,<4, so this resolves to the latest 1.x.
  "$venv/bin/pip" install -q 'openai>=1.99,<2'
  echo "$want" > "$stamp"
fi
"$venv/bin/python" -c 'import openai, sys; v = openai.__version__; print("openai", v); sys.exit(v.split(".")[0] != "1")'
exec "$venv/bin/pytest" -q -p no:cacheprovider tests/sdk "$@"
