#!/usr/bin/env bash
# Make sure `prometheus` and `promtool` are on PATH for tests/deploy/test_prometheus.py, which checks the alert
# rules in deploy/prometheus/ with promtool and runs a throw-away Prometheus (its own port and data directory)
# against a simulated cluster to prove every dashboard query has data. Idempotent: does nothing but say where
# the binaries are when both are there; else installs Debian's prometheus package (as root, or through sudo).
# The package's own service is not started: the test never uses it, and a container has no init to stop it.
set -euo pipefail
where() { echo "ensure-prometheus: $(command -v prometheus), $(command -v promtool)"; }
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  where
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-prometheus: no prometheus/promtool and no apt-get; install Prometheus yourself" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "ensure-prometheus: need root (or sudo) to install prometheus" >&2
    exit 1
  fi
fi
# Quiet: apt's and debconf's chatter goes to a log, shown only when a step fails.
log="$(mktemp -t ensure-prometheus-XXXXXX)"
# A policy-rc.d that says "no" keeps dpkg from starting the packaged service (a daemon on :9090 that would
# outlive the test run). Only ours is removed afterwards; an existing one is left alone.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod 755 "$policy"
  own_policy=1
fi
cleanup() {
  rm -f "$log"
  if [ "$own_policy" = 1 ]; then $sudo rm -f "$policy"; fi
}
trap cleanup EXIT
quiet() { if ! "$@" >>"$log" 2>&1; then cat "$log" >&2; exit 1; fi; }
export DEBIAN_FRONTEND=noninteractive
quiet $sudo apt-get update -qq
# Without recommends: they pull in prometheus-node-exporter, a second daemon nothing here needs.
quiet $sudo apt-get install -y -qq --no-install-recommends prometheus
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1
where
