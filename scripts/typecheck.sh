#!/usr/bin/env bash
# mypy needs the import names (kvtether.sdk …), but the rooms live in top-level folders:
# build a throw-away tree of symlinks that mirrors the installed layout and check that.
# The tree is private to this run (mktemp) so concurrent runs cannot trip over each other.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/kvtether"
for room in protocol sdk gateway sim cli vllm_plugin; do ln -s "$root/$room" "$tree/kvtether/$room"; done
cd "$tree"
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
  -p kvtether.protocol -p kvtether.sdk -p kvtether.gateway -p kvtether.sim -p kvtether.cli -p kvtether.vllm_plugin
# The benchmark scripts (not part of the package), against the same tree (the editable install's import
# hook is invisible to mypy).
MYPYPATH="$tree" "$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
  "$root/benchmarks"
# The tests' shared helpers (rigs, bodies, fixtures): every test module leans on them.
MYPYPATH="$tree:$root" "$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
  "$root/tests/support"
