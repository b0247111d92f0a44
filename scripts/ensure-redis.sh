#!/usr/bin/env bash
# Make sure a Redis (or Valkey) server binary is on PATH for the shared-store tests and benchmark, which start
# their own throw-away server on a free port. Idempotent: does nothing when `redis-server` or `valkey-server`
# is already there; else installs Debian's redis-server package (as root, or through sudo). The package's own
# service is not started: the tests never use it, and a container has no init to stop it again.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-redis: no redis-server and no apt-get; install Redis or Valkey yourself" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "ensure-redis: need root (or sudo) to install redis-server" >&2
    exit 1
  fi
fi
# A policy-rc.d that says "no" keeps dpkg from starting the packaged service (a daemon on :6379 that would
# outlive the test run). Only ours is removed afterwards; an existing one is left alone.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod 755 "$policy"
  own_policy=1
fi
cleanup() { if [ "$own_policy" = 1 ]; then $sudo rm -f "$policy"; fi; }
trap cleanup EXIT
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends redis-server >/dev/null
command -v redis-server >/dev/null 2>&1
echo "ensure-redis: $(redis-server --version)"
