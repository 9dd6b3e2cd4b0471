#!/usr/bin/env bash
# The CUDA checks for a borrowed GPU machine (issue 25), in two steps, since that machine has
# no Rust toolchain:
#
#   here:   scripts/cuda/device-check.sh prepare
#           builds tests/cuda.rs (--features cuda) and copies the binary to target/cuda-check/
#   there:  scripts/cuda/device-check.sh run      (device tool: carry ["target/cuda-check"])
#           runs it with FERRUM_REQUIRE_CUDA=1 (a missing driver or device fails instead of
#           skipping) and writes the log to $OUT/cuda-check.log
#
# What it checks so far: the device probe and the first kernels (RMSNorm, 8-bit activation
# quantisation, the Q8_0 dp4a matrix-vector product) against the CPU backend.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
prepare)
    bin=$(cargo test --release -p ferrum-backend --features cuda --test cuda --no-run \
        --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])')
    mkdir -p target/cuda-check
    cp "$bin" target/cuda-check/cuda-tests
    echo "target/cuda-check/cuda-tests ($(du -h target/cuda-check/cuda-tests | cut -f1)): carry target/cuda-check"
    ;;
run)
    out="${OUT:-target/cuda-check}"
    export LD_LIBRARY_PATH="/usr/local/nvidia/lib64:/usr/local/nvidia/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    {
        nvidia-smi -L || true
        FERRUM_REQUIRE_CUDA=1 target/cuda-check/cuda-tests --test-threads 1 --nocapture
    } 2>&1 | tee "$out/cuda-check.log"
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
