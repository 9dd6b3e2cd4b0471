#!/usr/bin/env bash
# The Vulkan backend on a lent GPU machine (issue 41; docs/gpu.md), in two steps, since that
# machine has no Rust toolchain:
#
#   here:   scripts/vulkan/device-check.sh prepare
#           builds (release) the `ferrum` binary, the conformance harness, the golden-model
#           test and the synthetic-model generator, stripped, into target/vulkan-check/ with
#           the Llama 3 vocabulary they need, and downloads the Vulkan loader's packages into
#           .gl/ (the device tool's README: that machine may have no libvulkan)
#   there:  scripts/vulkan/device-check.sh run
#           (device tool: carry ["target/vulkan-check", ".gl"], timeout_s 600)
#           1. `ferrum devices`
#           2. the conformance harness on the GPU against the CPU's exact mode
#           3. the golden tiny models on the GPU against transformers
#           4. 1B- and 8B-shaped Q4_K_M files (Llama 3.2 1B's and Llama 3.1 8B's shapes,
#              random weights), written there, then `ferrum bench --device vulkan`: prefill
#              (pp512) and decode (tg128) tok/s, and decode's share of HBM bandwidth
#              (BANDWIDTH_GBS, default 4800 for an H200)
#           everything into $OUT/vulkan-check.log. SKIP_8B=1 leaves the 8B file out; DRY=1
#           (a check of the script itself, on lavapipe) makes one-layer files and a short bench.
#
# The test binaries find the fixtures through the absolute path they were built in; `run`
# links that path to the copy it runs in when they differ.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=target/vulkan-check
case "${1:-}" in
prepare)
    mkdir -p "$dest"
    cargo build --release -p ferrum-cli
    cargo build --release -p ferrum-quantize --example synth_moe
    for spec in "ferrum-backend conformance" "ferrum-models vulkan_golden"; do
        set -- $spec
        bin=$(cargo test --release -p "$1" --test "$2" --no-run --message-format=json 2>/dev/null |
            python3 -c 'import json,sys
name = sys.argv[1]
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
        print(m["executable"])' "$2")
        cp "$bin" "$dest/$2"
    done
    cp target/release/ferrum target/release/examples/synth_moe "$dest/"
    strip "$dest"/* 2>/dev/null || true
    vocab="${FERRUM_CACHE:-$HOME/.cache/ferrum}/llama-vocab/ggml-vocab-llama-bpe.gguf"
    [[ -f "$vocab" ]] || scripts/fetch-test-assets.sh >/dev/null
    cp "$vocab" "$dest/"
    pwd >"$dest/built-in"
    # The Vulkan loader for a machine without one (the device tool's README).
    grep -qx '/.gl/' .git/info/exclude 2>/dev/null || echo /.gl/ >>.git/info/exclude
    mkdir -p .gl /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    # shellcheck disable=SC2086
    apt-get $o update -qq >/dev/null
    # shellcheck disable=SC2086
    (cd .gl && apt-get $o download libvulkan1 >/dev/null)
    du -sh "$dest" .gl
    echo "carry [\"$dest\", \".gl\"] and run: scripts/vulkan/device-check.sh run"
    ;;
run)
    out="${OUT:-$dest}"
    log="$out/vulkan-check.log"
    built=$(cat "$dest/built-in")
    if [[ "$built" != "$PWD" && ! -e "$built" ]]; then
        mkdir -p "$(dirname "$built")"
        ln -s "$PWD" "$built"
    fi
    if ! ldconfig -p | grep -q libvulkan.so.1 && ls .gl/*.deb >/dev/null 2>&1; then
        for f in .gl/*.deb; do dpkg -x "$f" /; done
        ldconfig
    fi
    icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    if [[ -f "$icd" && -z "${VK_DRIVER_FILES:-}" ]] && ! ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json >/dev/null 2>&1; then
        export VK_DRIVER_FILES=$icd
    fi
    export LD_LIBRARY_PATH="/usr/local/nvidia/lib64:/usr/local/nvidia/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export FERRUM_REQUIRE_VULKAN=1
    bw="${BANDWIDTH_GBS:-4800}"
    models="$out/models"
    mkdir -p "$models"
    {
        echo "== devices"
        nvidia-smi -L || true
        "$dest/ferrum" devices
        echo "== conformance harness (GPU vs the CPU's exact mode)"
        "$dest/conformance" vulkan --nocapture 2>&1 | grep -v ' ok$' || true
        echo "== golden models"
        "$dest/vulkan_golden" --nocapture --test-threads 1 || true
        shapes=("1b --arch llama")
        [[ -n "${SKIP_8B:-}" ]] || shapes+=("8b --arch llama --layers 32 --hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --head-dim 128")
        bench=(--pp 512 --tg 128 --reps 3)
        if [[ -n "${DRY:-}" ]]; then
            shapes=("1b --arch llama --layers 1")
            bench=(--pp 8 --tg 4 --reps 1)
        fi
        for s in "${shapes[@]}"; do
            set -- $s
            name=$1
            shift
            f="$models/llama-$name-q4_k_m.gguf"
            echo "== $name: writing $f"
            "$dest/synth_moe" "$f" --type Q4_K_M --vocab-from "$dest/ggml-vocab-llama-bpe.gguf" "$@"
            echo "== $name: ferrum bench --device vulkan"
            "$dest/ferrum" bench "$f" --device vulkan "${bench[@]}" --json >"$out/bench-$name.json" || true
            python3 - "$out/bench-$name.json" "$f" "$bw" <<'PY' || cat "$out/bench-$name.json"
import json, os, sys
b = json.load(open(sys.argv[1]))
size, bw = os.path.getsize(sys.argv[2]), float(sys.argv[3]) * 1e9
tg, pp = b.get("tg_tok_s"), b.get("pp_tok_s")
per_token = b.get("weight_bytes_per_token") or size
print(f"{b.get('backend')}: pp{b.get('pp')} {pp:.1f} tok/s, tg{b.get('tg')} {tg:.1f} tok/s; decode reads {per_token / 1e9:.2f} GB a token: "
      f"{100 * tg * per_token / bw:.1f}% of {bw / 1e9:.0f} GB/s" if tg else json.dumps(b))
PY
            rm -f "$f"
        done
    } 2>&1 | tee "$log"
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
