#!/usr/bin/env bash
# Builds ik_llama.cpp's llama-bench (and llama-quantize, llama-perplexity) for this machine,
# for scripts/bench-vs-llamacpp.sh's third engine (IK_LLAMA_BENCH). A developer tool, not CI.
#
#   scripts/build-ik-llamacpp.sh SRC [BUILD_DIR]
#
# SRC is a checkout of https://github.com/ikawrakow/ik_llama.cpp (no package registry ships
# it, so it cannot be fetched here; copy it in). Only the tools above are configured: the
# examples folder's CMakeLists is replaced by one naming them, so a checkout without the
# other examples (or their web assets) still builds. Prints the llama-bench path.
# Environment: IK_CMAKE_FLAGS (default -DGGML_NATIVE=ON), PYTHON (for pip's cmake/ninja).
set -euo pipefail
SRC="${1:?usage: build-ik-llamacpp.sh SRC [BUILD_DIR]}"
BUILD="${2:-$SRC/build-native}"
FLAGS="${IK_CMAKE_FLAGS:--DGGML_NATIVE=ON}"
[[ -f "$SRC/CMakeLists.txt" && -d "$SRC/ggml/src/iqk" ]] || {
    echo "$SRC is not an ik_llama.cpp checkout (no ggml/src/iqk)" >&2
    exit 1
}
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
    "${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check cmake ninja >&2
fi
if ! grep -q "ferrum's benchmark build" "$SRC/examples/CMakeLists.txt"; then
    cp "$SRC/examples/CMakeLists.txt" "$SRC/examples/CMakeLists.txt.orig"
    cat >"$SRC/examples/CMakeLists.txt" <<'EOF'
# ferrum's benchmark build of ik_llama.cpp: only the tools it runs.
find_package(Threads REQUIRED)
include_directories(${CMAKE_CURRENT_SOURCE_DIR})
add_subdirectory(batched-bench)
add_subdirectory(llama-bench)
add_subdirectory(quantize)
add_subdirectory(perplexity)
EOF
    # The proofs of concept are not needed either.
    sed -i 's/^\(\s*\)add_subdirectory(pocs)$/\1# pocs: not in the benchmark build/' "$SRC/CMakeLists.txt"
fi
# shellcheck disable=SC2086 # a list of flags
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release $FLAGS -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >"$BUILD.cmake.log" 2>&1 \
    || { echo "cmake configure failed, see $BUILD.cmake.log" >&2; exit 1; }
echo "$FLAGS" >"$BUILD.flags"
echo "building ik_llama.cpp (about 15 minutes on 2 cores)" >&2
cmake --build "$BUILD" --target llama-bench llama-quantize llama-perplexity -j "$(nproc)" \
    >>"$BUILD.cmake.log" 2>&1 || { echo "build failed, see $BUILD.cmake.log" >&2; exit 1; }
echo "$BUILD/bin/llama-bench"
