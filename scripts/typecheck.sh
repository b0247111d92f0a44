#!/usr/bin/env bash
# mypy needs the import names (kvtether.sdk …), but the rooms live in top-level folders:
# build a throw-away tree of symlinks that mirrors the installed layout and check that.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
rm -rf .typecheck && mkdir -p .typecheck/kvtether
for room in sdk gateway sim cli; do ln -s "../../$room" ".typecheck/kvtether/$room"; done
cd .typecheck
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" -p kvtether.sdk -p kvtether.gateway -p kvtether.sim -p kvtether.cli
