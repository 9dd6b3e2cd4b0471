#!/usr/bin/env bash
# Regenerates the committed PTX of ferrum's CUDA kernels (crates/ferrum-backend/src/cuda/
# kernels.cu -> src/cuda/ptx/kernels.sm_80.ptx, kernels.sm_90.ptx) with NVRTC and reports
# each kernel's registers and spills with ptxas, both from NVIDIA's PyPI wheels (pinned to
# CUDA 13.0, the device machine's driver: a newer NVRTC writes PTX that driver refuses). No
# CUDA toolkit and no GPU needed.
#
#   scripts/cuda/build-ptx.sh          rewrite the PTX files
#   scripts/cuda/build-ptx.sh --check  fail if the committed PTX differs from a fresh build (CI)
#
# Cache: ${FERRUM_CACHE:-$HOME/.cache/ferrum}/cuda-13.0.88 (the unpacked wheels).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=13.0.88
CACHE="${FERRUM_CACHE:-$HOME/.cache/ferrum}/cuda-$VERSION"
if [ ! -f "$CACHE/.complete" ]; then
    rm -rf "$CACHE" && mkdir -p "$CACHE/wheels"
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$CACHE/wheels" \
        "nvidia-cuda-nvrtc==$VERSION" "nvidia-cuda-nvcc==$VERSION" >&2
    for w in "$CACHE"/wheels/*.whl; do python3 -m zipfile -e "$w" "$CACHE"; done
    rm -rf "$CACHE/wheels"
    touch "$CACHE/.complete"
fi
LIB="$CACHE/nvidia/cu13/lib/libnvrtc.so.13"
PTXAS="$CACHE/nvidia/cu13/bin/ptxas"
chmod +x "$PTXAS"
SRC=crates/ferrum-backend/src/cuda/kernels.cu
DST=crates/ferrum-backend/src/cuda/ptx
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
status=0
for arch in 80 90; do
    # NVRTC opens its builtins library by name.
    LD_LIBRARY_PATH="$(dirname "$LIB")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        python3 scripts/cuda/nvrtc_ptx.py "$LIB" "$SRC" "$arch" "$OUT/kernels.sm_$arch.ptx"
    echo "== sm_$arch: registers and spills (ptxas -v)" >&2
    "$PTXAS" -v --gpu-name "sm_$arch" "$OUT/kernels.sm_$arch.ptx" -o "$OUT/kernels.sm_$arch.cubin" 2>&1 \
        | grep -E "Compiling entry|registers|spill" >&2
    if [ "${1:-}" = "--check" ]; then
        if ! cmp -s "$OUT/kernels.sm_$arch.ptx" "$DST/kernels.sm_$arch.ptx"; then
            echo "build-ptx: $DST/kernels.sm_$arch.ptx differs from a fresh NVRTC build of $SRC" >&2
            echo "  (run scripts/cuda/build-ptx.sh and commit the result)" >&2
            status=1
        fi
    else
        cp "$OUT/kernels.sm_$arch.ptx" "$DST/"
    fi
done
exit $status
