#!/usr/bin/env bash
# A headless browser for the `kvtether assess` report test: Debian's chromium package, installed with apt when
# it is missing (as root; there is no other way to get it on a fresh test machine). Prints the binary's path.
# Exit 0 with the path on stdout when a browser is there; exit 3 when it cannot be had (no apt, not root, no
# network): the caller skips its test.
set -euo pipefail
for name in chromium chromium-browser google-chrome; do
  if command -v "$name" >/dev/null 2>&1; then command -v "$name"; exit 0; fi
done
if ! command -v apt-get >/dev/null 2>&1; then echo "no apt-get: cannot install chromium" >&2; exit 3; fi
if [ "$(id -u)" != 0 ]; then echo "not root: cannot install chromium with apt-get" >&2; exit 3; fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get update -qq >&2 || ! apt-get install -y -qq chromium >&2; then
  echo "apt-get could not install chromium" >&2; exit 3
fi
command -v chromium
