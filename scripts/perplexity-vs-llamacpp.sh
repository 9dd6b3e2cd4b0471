#!/usr/bin/env bash
# Perplexity of the same GGUF files on the same text under ferrum and under llama.cpp, by one
# protocol (windows of CTX tokens, each from position 0, every position scored: what `ferrum
# perplexity` does; llama.cpp's side is scripts/fixtures/llamacpp_perplexity.cpp built against
# its library). A developer tool, not run by CI.
#
#   scripts/perplexity-vs-llamacpp.sh A.gguf [B.gguf …]
#
# Environment:
#   TEXT=file          the text (default: tests/fixtures/smollm2/passage.txt and the prose of
#                      scripts/quantize-quality.sh, repeated to about 3,000 tokens)
#   CTX=512            window
#   FERRUM=target/release/ferrum
#   LLAMACPP_BUILD=$FERRUM_CACHE/llamacpp-build/build-native   a llama.cpp build (its bin/
#                      holds libllama.so; scripts/bench-vs-llamacpp.sh makes one)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${FERRUM_CACHE:-$HOME/.cache/ferrum}"
CTX="${CTX:-512}"
FERRUM="${FERRUM:-$ROOT/target/release/ferrum}"
BUILD="${LLAMACPP_BUILD:-$CACHE/llamacpp-build/build-native}"
SRC="$(ls -d "$CACHE"/llamacpp-build/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -1)"
[[ $# -ge 1 ]] || { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
[[ -f "$BUILD/bin/libllama.so" ]] || { echo "no llama.cpp build at $BUILD" >&2; exit 1; }
[[ -d "$SRC" ]] || { echo "no llama.cpp source under $CACHE/llamacpp-build" >&2; exit 1; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
TOOL="$BUILD/ferrum-llamacpp-perplexity"
if [[ ! -x "$TOOL" || "$ROOT/scripts/fixtures/llamacpp_perplexity.cpp" -nt "$TOOL" ]]; then
    c++ -O2 -std=c++17 "$ROOT/scripts/fixtures/llamacpp_perplexity.cpp" -o "$TOOL" \
        -I"$SRC/include" -I"$SRC/ggml/include" -L"$BUILD/bin" -lllama -lggml -lggml-base \
        -Wl,-rpath,"$BUILD/bin"
fi
if [[ -n "${TEXT:-}" ]]; then
    cp "$TEXT" "$WORK/eval.txt"
else
    # The same passage and prose as scripts/quantize-quality.sh, four times over.
    sed -n '/^cat >> "\$TEXTFILE" <<.TXT.$/,/^TXT$/p' "$ROOT/scripts/quantize-quality.sh" \
        | sed '1d;$d' > "$WORK/prose.txt"
    for _ in 1 2 3 4; do
        cat "$ROOT/tests/fixtures/smollm2/passage.txt" "$WORK/prose.txt" >> "$WORK/eval.txt"
    done
fi
printf '| file | tokens | ferrum | llama.cpp | ferrum / llama.cpp |\n|---|--:|--:|--:|--:|\n'
for m in "$@"; do
    ours="$("$FERRUM" perplexity --model "$m" --file "$WORK/eval.txt" --ctx "$CTX" --device cpu)"
    theirs="$("$TOOL" "$m" "$WORK/eval.txt" "$CTX" 2 2>/dev/null)"
    python3 - "$m" "$ours" "$theirs" <<'PY'
import json, os, sys
m, a, b = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
if a["tokens"] != b["tokens"]:
    sys.exit(f"{m}: the tokenisers disagree ({a['tokens']} vs {b['tokens']} scored tokens)")
print(f"| {os.path.basename(m)} | {a['tokens']} | {a['perplexity']:.4f} | {b['perplexity']:.4f} "
      f"| {a['perplexity'] / b['perplexity']:.4f} |")
PY
done
