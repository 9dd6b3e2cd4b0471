#!/usr/bin/env bash
# Image prefill on the CPU: `ferrum bench --image` against llama.cpp's `llama-mtmd-cli`, same
# language model, same mmproj file, same image, same threads, in alternating rounds; medians.
#
#   MTMD=/path/to/llama-mtmd-cli scripts/bench-image-vs-llamacpp.sh MODEL.gguf MMPROJ.gguf IMAGE [ROUNDS]
#
# llama.cpp's figures are the two it prints with -v: "mtmd batch encoding done in N ms" (the
# vision tower) and "image decoded (batch 1/1) in N ms" (the image's rows through the language
# model).
# ferrum's are its `encode_ms` and `prefill_ms` (`bench --image --reps 1`: one warm-up run,
# then one timed run, as llama.cpp warms its encoder at load). Preprocessing (decode, resize,
# normalise) is reported by ferrum apart and left out of both sums.
# Make a Gemma-3-4B-shaped pair with scripts/make_gemma3_vlm_bench.py.
set -euo pipefail
MODEL=$1 MMPROJ=$2 IMAGE=$3 ROUNDS=${4:-3}
FERRUM=${FERRUM:-target/release/ferrum}
MTMD=${MTMD:?set MTMD to the llama-mtmd-cli of a llama.cpp build}
# ferrum's pool is the CPUs this process may use: nproc of them (taskset for fewer).
THREADS=$(nproc)
echo "ferrum: $($FERRUM --version 2>/dev/null || echo ferrum) ($FERRUM), threads $THREADS"
echo "llama.cpp: $MTMD"
grep -m1 "model name" /proc/cpuinfo || true
fe=() fp=() le=() ld=()
for r in $(seq "$ROUNDS"); do
    out=$("$MTMD" -m "$MODEL" --mmproj "$MMPROJ" --image "$IMAGE" -p "Describe." -n 1 \
        --temp 0 -t "$THREADS" -v 2>&1 || true)
    e=$(sed -n 's/.*mtmd batch encoding done in \([0-9.]*\) ms.*/\1/p' <<<"$out" | head -1)
    d=$(sed -n 's/.*image decoded (batch 1\/1) in \([0-9.]*\) ms.*/\1/p' <<<"$out" | head -1)
    if [ -z "$e" ] || [ -z "$d" ]; then
        echo "llama-mtmd-cli printed no timings:"; tail -20 <<<"$out"; exit 1
    fi
    j=$("$FERRUM" bench "$MODEL" --mmproj "$MMPROJ" --device cpu \
        --image "$IMAGE" --reps 1 --json)
    fenc=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["encode_ms"])' "$j")
    fpre=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["prefill_ms"])' "$j")
    echo "round $r: llama.cpp encode $e ms + decode $d ms; ferrum encode $fenc ms + prefill $fpre ms"
    le+=("$e") ld+=("$d") fe+=("$fenc") fp+=("$fpre")
done
python3 - "${le[*]}" "${ld[*]}" "${fe[*]}" "${fp[*]}" <<'EOF'
import statistics, sys
le, ld, fe, fp = ([float(x) for x in a.split()] for a in sys.argv[1:5])
m = statistics.median
lt, ft = [a + b for a, b in zip(le, ld)], [a + b for a, b in zip(fe, fp)]
print(f"medians: llama.cpp encode {m(le):.0f} ms, decode {m(ld):.0f} ms, total {m(lt):.0f} ms")
print(f"         ferrum    encode {m(fe):.0f} ms, prefill {m(fp):.0f} ms, total {m(ft):.0f} ms")
ratios = [l / f for l, f in zip(lt, ft)]
print(f"ferrum / llama.cpp speed (median of per-round ratios): {m(ratios):.2f}x"
      f" (encode {m([l / f for l, f in zip(le, fe)]):.2f}x, prefill {m([l / f for l, f in zip(ld, fp)]):.2f}x)")
EOF
