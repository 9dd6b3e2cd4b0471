#!/usr/bin/env bash
# Compiles the Vulkan backend's GLSL compute shaders (crates/ferrum-backend/src/vulkan/shaders)
# to SPIR-V with glslc (Debian's `glslc` package; Vulkan 1.1 target) into shaders/spv/, which
# is committed and embedded in the binary: building ferrum needs no shader compiler.
# `--check` compiles into a temporary folder and fails if the committed SPIR-V differs (CI).
set -euo pipefail
cd "$(dirname "$0")/../.."
src=crates/ferrum-backend/src/vulkan/shaders
if ! command -v glslc >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q glslc >/dev/null
    else
        echo "build-shaders: glslc not found (apt-get install glslc)" >&2
        exit 1
    fi
fi
out=$src/spv
if [ "${1:-}" = --check ]; then
    out=$(mktemp -d)
    trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
cc() { glslc --target-env=vulkan1.1 -O -I"$src" "$@"; }
# The weight formats, in the order of `Fmt` in src/vulkan/mod.rs (FMT in dequant.glsl).
formats=(f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k mxfp4)
for i in "${!formats[@]}"; do
    # A matmul for one token (decode) and one for passes of several, and the row gather.
    cc -DFMT="$i" -DTT=1 "$src/matmul.comp" -o "$out/matvec_${formats[$i]}.spv"
    cc -DFMT="$i" -DTT=8 "$src/matmul.comp" -o "$out/matmul_${formats[$i]}.spv"
    cc -DFMT="$i" "$src/get_rows.comp" -o "$out/get_rows_${formats[$i]}.spv"
done
for s in rms_norm rope copy rows_index scatter_add eltwise glu attention; do
    cc "$src/$s.comp" -o "$out/$s.spv"
done
if [ "${1:-}" = --check ]; then
    if ! diff -r "$out" "$src/spv" >/dev/null; then
        echo "build-shaders: committed SPIR-V differs from glslc's (run scripts/vulkan/build-shaders.sh)" >&2
        diff -rq "$out" "$src/spv" >&2 || true
        exit 1
    fi
    echo "build-shaders: committed SPIR-V is current ($(glslc --version | head -1))"
fi
