#!/usr/bin/env bash
# Runs the fuzz targets of crates/ferrum-fuzz under AFL++ (cargo-afl, from crates.io) for a
# number of executions each, and prints each one's figures (executions, crashes, hangs).
#
#   scripts/fuzz.sh [TARGET|all] [EXECUTIONS]     # default: all, 1000000
#
# Findings land in target/fuzz/<target>/default/{crashes,hangs}; a crash, once fixed, goes
# into crates/ferrum-fuzz/tests/regressions/<target>/ so the test suite replays it. The test
# suite's own short run of every target is crates/ferrum-fuzz/tests/smoke.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
which="${1:-all}"
execs="${2:-1000000}"
if ! command -v cargo-afl >/dev/null; then
    cargo install cargo-afl --version '^0.15' --locked
fi
(cd fuzz && cargo afl build --release)
bin="fuzz/target/release/target"
if [ "$which" = all ]; then
    targets="gguf gguf_vocab hf_folder chat_template openai_request json_schema image"
else
    targets="$which"
fi
for t in $targets; do
    out="target/fuzz/$t"
    rm -rf "$out" && mkdir -p "$out"
    FERRUM_FUZZ_TARGET="$t" "$bin" --seeds "$out/seeds"
    # -E: stop after that many executions; -t: a hang is an input over two seconds.
    FERRUM_FUZZ_TARGET="$t" AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 \
        AFL_QUIET=1 cargo afl fuzz -i "$out/seeds" -o "$out" -E "$execs" -t 2000 -- "$bin" \
        >"$out/afl.log" 2>&1 || { echo "$t: afl-fuzz failed, see $out/afl.log"; tail -20 "$out/afl.log"; exit 1; }
    stats="$out/default/fuzzer_stats"
    get() { awk -F' *: *' -v k="$1" '$1 == k {print $2}' "$stats"; }
    echo "$t: $(get execs_done) executions in $(( $(get last_update) - $(get start_time) )) s," \
         "$(get corpus_count) corpus entries, edges $(get edges_found)/$(get total_edges)," \
         "crashes $(get saved_crashes), hangs $(get saved_hangs)"
done
