#!/usr/bin/env bash
# Speed of ferrum against llama.cpp on the same files, same machine, same run (a developer
# tool, not run by CI). See docs/performance.md for what the figures mean.
#
#   scripts/bench-vs-llamacpp.sh                 # SmolLM2-135M Q4_1, Q8_0, Q4_K_M
#   scripts/bench-vs-llamacpp.sh --moe           # ... plus synthetic Qwen3-MoE Q8_0, Q4_K_M
#   scripts/bench-vs-llamacpp.sh [--moe] A.gguf B.gguf   # just these files (plus MoE)
#   scripts/bench-vs-llamacpp.sh --batched [A.gguf …]     # many streams at once (SmolLM2 Q4_1)
#
# For each file, ROUNDS rounds of `llama-bench -p PP -n TG -r 1` and `ferrum bench --reps 1`,
# alternating (which one goes first alternates too), then a markdown table of medians and
# ratios. Raw JSON and the table are kept in OUT_DIR.
#
# With --batched, the rounds are `llama-batched-bench -npp PP -ntg TG -npl LEVELS` against
# `ferrum bench --concurrency LEVELS`: each stream its own PP-token prompt, then TG tokens;
# the table gives, per number of streams, the aggregate decode rate of each engine (llama.cpp's
# S_TG; ferrum's rate while every stream decodes), its ratio to one stream, and ferrum over
# llama.cpp.
#
# Environment:
#   ROUNDS=5 PP=512 TG=128 THREADS=2   rounds, prompt and generated tokens (--batched: PP=128),
#                                      threads (when fewer than the CPUs this process may use,
#                                      both engines are pinned to the same first THREADS of them)
#   LEVELS=1,2,4,8                     numbers of streams with --batched (include 1: the
#                                      "× one" columns divide by it)
#   LLAMA_BENCH=/path/llama-bench      use this llama-bench, build nothing
#   LLAMACPP_BIN=/dir                  use llama-bench from this folder (e.g. an existing build)
#   LLAMACPP_CMAKE_FLAGS="..."         override the CPU flags of the llama.cpp build
#   ISA=native|avx2                    native (default): llama.cpp built for this machine
#                                      (GGML_NATIVE=ON: -march=native, AMX included where the
#                                      CPU has it) and ferrum with every instance it detects. If
#                                      that build faults on the first file (some VMs here list
#                                      AVX-512 or AMX and fault on it), it gives way to one with
#                                      the x86 extensions /proc/cpuinfo lists named one by one
#                                      (AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX-512 F/BW/VL/DQ,
#                                      VBMI, VNNI, BF16; AMX off), and if that faults too, to
#                                      avx2. avx2: both engines on AVX2 + FMA only. With
#                                      LLAMACPP_BIN/LLAMA_BENCH say which build it is (ISA=native
#                                      or avx2).
#   LLAMA_BENCH_ARGS="--repack 0"      extra llama-bench options (default: none, its defaults;
#                                      not passed to llama-batched-bench)
#   IK_LLAMA_BENCH=/path/llama-bench   ik_llama.cpp's llama-bench: a third engine in every round
#                                      (not with --batched). No package registry ships
#                                      ik_llama.cpp, so it is built from its repository's source
#                                      by scripts/build-ik-llamacpp.sh SRC (GGML_NATIVE=ON).
#   IK_ARGS="-rtr 1"                   its options (default: -rtr 1, its load-time repacking)
#   MOE_DIR=$FERRUM_CACHE/synth-moe    where the synthetic MoE files live (made if missing)
#   MOE_LAYERS=4                       layers of the synthetic MoE files
#   OUT_DIR=target/bench-vs-llamacpp/DATE
#   FERRUM_CACHE=~/.cache/ferrum       cache of models and the llama.cpp build
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${FERRUM_CACHE:-$HOME/.cache/ferrum}"
ROUNDS="${ROUNDS:-5}"
BATCHED=0
QUANTISE_SMOL=
for a in "$@"; do
    if [[ "$a" == --batched ]]; then BATCHED=1; fi
done
PP="${PP:-$( ((BATCHED)) && echo 128 || echo 512)}"
LEVELS="${LEVELS:-1,2,4,8}"
TG="${TG:-128}"
THREADS="${THREADS:-2}"
PYTHON="${PYTHON:-python3}"
LLAMACPP_VERSION="0.3.36"
MOE_DIR="${MOE_DIR:-$CACHE/synth-moe}"
MOE_LAYERS="${MOE_LAYERS:-4}"
OUT_DIR="${OUT_DIR:-$ROOT/target/bench-vs-llamacpp/$(date +%Y%m%d-%H%M%S)}"

log() { echo "[bench-vs-llamacpp] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Both engines on the same machine's instruction sets: ferrum picks its kernels at run time,
# llama.cpp is built for them.
ISA="${ISA:-native}"
case "$ISA" in
    native) unset FERRUM_AVXVNNI ;;
    avx2) export FERRUM_AVXVNNI=0 ;;
    *) die "ISA must be native or avx2 (got $ISA)" ;;
esac
# The llama.cpp build: native (GGML_NATIVE=ON), explicit (native_flags: named extensions, no
# AMX; the fallback where native faults) or avx2.
BUILD="$ISA"

# llama.cpp's CMake flags for the x86 extensions this CPU lists (native without AMX).
native_flags() {
    local f="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    local flags
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    has() { [[ "$flags" == *" $1 "* ]]; }
    has avx && f+=" -DGGML_AVX=ON"
    has avx2 && f+=" -DGGML_AVX2=ON"
    has fma && f+=" -DGGML_FMA=ON"
    has f16c && f+=" -DGGML_F16C=ON"
    has bmi2 && f+=" -DGGML_BMI2=ON"
    has avx_vnni && f+=" -DGGML_AVX_VNNI=ON"
    if has avx512f && has avx512bw && has avx512vl && has avx512dq; then
        f+=" -DGGML_AVX512=ON"
        has avx512vbmi && f+=" -DGGML_AVX512_VBMI=ON"
        has avx512_vnni && f+=" -DGGML_AVX512_VNNI=ON"
        has avx512_bf16 && f+=" -DGGML_AVX512_BF16=ON"
    fi
    echo "$f"
}

MOE=0
FILES=()
for a in "$@"; do
    case "$a" in
        --moe) MOE=1 ;;
        --batched) ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $a (see --help)" ;;
        *) [[ -f "$a" ]] || die "$a: no such file"; FILES+=("$(cd "$(dirname "$a")" && pwd)/$(basename "$a")") ;;
    esac
done

# --- llama.cpp ----------------------------------------------------------------------------
# Built once from the llama-cpp-python sdist (which vendors llama.cpp) into the cache.
build_llamacpp() {
    local dir="$CACHE/llamacpp-build"
    local build="$dir/build-$BUILD"
    local bin="$build/bin"
    if [[ -x "$bin/llama-bench" && -x "$bin/llama-quantize" && -x "$bin/llama-batched-bench" ]]; then
        echo "$bin"
        return
    fi
    mkdir -p "$dir"
    local src="$dir/llama_cpp_python-$LLAMACPP_VERSION/vendor/llama.cpp"
    if [[ ! -f "$src/CMakeLists.txt" ]]; then
        log "downloading the llama-cpp-python==$LLAMACPP_VERSION sdist"
        "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
            --no-binary llama-cpp-python "llama-cpp-python==$LLAMACPP_VERSION" -d "$dir" >&2
        tar -xzf "$dir/llama_cpp_python-$LLAMACPP_VERSION.tar.gz" -C "$dir"
    fi
    if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
        log "installing cmake and ninja with pip"
        "$PYTHON" -m pip install --quiet --disable-pip-version-check cmake ninja >&2
    fi
    # GGML_NATIVE by default; the named x86 extensions where it faults (its AMX kernels did
    # on some VMs here: SIGSEGV in ldtilecfg).
    local cpu_flags
    if [[ -n "${LLAMACPP_CMAKE_FLAGS:-}" ]]; then
        cpu_flags="$LLAMACPP_CMAKE_FLAGS"
    elif [[ "$(uname -m)" != x86_64 || "$BUILD" == native ]]; then
        cpu_flags="-DGGML_NATIVE=ON"
    elif [[ "$BUILD" == explicit ]]; then
        cpu_flags="$(native_flags)"
    else
        cpu_flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    fi
    log "llama.cpp CPU flags: $cpu_flags"
    echo "$cpu_flags" >"$build.flags"
    log "building llama-bench, llama-batched-bench and llama-quantize (about 10 minutes on 2 cores)"
    # shellcheck disable=SC2086 # cpu_flags is a list of flags
    cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release $cpu_flags \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >"$dir/cmake.log" 2>&1 \
        || die "cmake configure failed, see $dir/cmake.log"
    cmake --build "$build" --target llama-bench llama-batched-bench llama-quantize -j "$(nproc)" \
        >>"$dir/cmake.log" 2>&1 || die "llama.cpp build failed, see $dir/cmake.log"
    echo "$bin"
}

LLAMA_BENCH_GIVEN="${LLAMA_BENCH:-}${LLAMACPP_BIN:-}"
if [[ -n "${LLAMA_BENCH:-}" ]]; then
    [[ -x "$LLAMA_BENCH" ]] || die "LLAMA_BENCH=$LLAMA_BENCH is not executable"
elif [[ -n "${LLAMACPP_BIN:-}" ]]; then
    LLAMA_BENCH="$LLAMACPP_BIN/llama-bench"
    [[ -x "$LLAMA_BENCH" ]] || die "no llama-bench in LLAMACPP_BIN=$LLAMACPP_BIN"
else
    LLAMA_BENCH="$(build_llamacpp)/llama-bench"
fi
LLAMA_BATCHED="$(dirname "$LLAMA_BENCH")/llama-batched-bench"
((BATCHED == 0)) || [[ -x "$LLAMA_BATCHED" ]] || die "no llama-batched-bench beside $LLAMA_BENCH"
# The shared libraries sit beside the binaries.
LD_LIBRARY_PATH="$(dirname "$LLAMA_BENCH")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
# The CPU flags of a build this script made, for the table.
flags_of() { local f; f="$(dirname "$(dirname "$1")").flags"; [[ -f "$f" ]] && cat "$f" || true; }
LLAMACPP_FLAGS="$(flags_of "$LLAMA_BENCH")"
export LLAMACPP_FLAGS

# --- ferrum -------------------------------------------------------------------------------
log "building ferrum (release)"
(cd "$ROOT" && cargo build --release --quiet) || die "cargo build --release failed"
# Fewer threads than CPUs: both engines on the same CPUs (ferrum sizes its pool by them).
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || die "THREADS must be a positive number (got $THREADS)"
PIN=()
ALLOWED="$("$PYTHON" -c 'import os; print(" ".join(map(str, sorted(os.sched_getaffinity(0)))))')"
read -r -a ALLOWED <<<"$ALLOWED"
if ((THREADS < ${#ALLOWED[@]})); then
    command -v taskset >/dev/null || die "THREADS=$THREADS needs taskset (util-linux)"
    PIN=(taskset -c "$(IFS=,; echo "${ALLOWED[*]:0:THREADS}")")
fi
FERRUM=("${PIN[@]}" "$ROOT/target/release/ferrum")

# --- model files --------------------------------------------------------------------------
if [[ ${#FILES[@]} -eq 0 ]]; then
    SMOL="$("$ROOT/scripts/fetch-default-model.sh" | tail -n 1)"
    [[ -f "$SMOL" ]] || die "fetch-default-model.sh gave no model"
    FILES+=("$SMOL")
    # The batched comparison is the issue's: the shipped file alone.
    ((BATCHED)) || QUANTISE_SMOL=1
fi
if [[ -n "${QUANTISE_SMOL:-}" ]]; then
    QDIR="$CACHE/bench-models"
    mkdir -p "$QDIR"
    for t in Q8_0 Q4_K_M; do
        q="$QDIR/SmolLM2-135M-Instruct.$t.gguf"
        if [[ ! -f "$q" ]]; then
            log "quantising SmolLM2 to $t with ferrum quantize (from the shipped Q4_1)"
            "${FERRUM[@]}" quantize "$SMOL" "$q.partial" --type "$t" >&2
            mv "$q.partial" "$q"
        fi
        FILES+=("$q")
    done
fi
if [[ $MOE -eq 1 ]]; then
    mkdir -p "$MOE_DIR"
    for t in Q8_0 Q4_K_M; do
        m="$MOE_DIR/qwen3moe-synth-${MOE_LAYERS}L-$t.gguf"
        if [[ ! -f "$m" ]]; then
            vocab="$CACHE/llama-vocab/ggml-vocab-qwen2.gguf"
            [[ -f "$vocab" ]] || "$ROOT/scripts/fetch-test-assets.sh" >/dev/null
            log "generating $m (a few minutes)"
            (cd "$ROOT" && cargo run --release --quiet -p ferrum-quantize --example synth_moe -- \
                "$m" --type "$t" --layers "$MOE_LAYERS" --vocab-from "$vocab") \
                || die "synth_moe failed"
        fi
        FILES+=("$m")
    done
fi

# --- runs ---------------------------------------------------------------------------------
mkdir -p "$OUT_DIR"
log "results in $OUT_DIR"
run_llama() { # file round
    local out
    out="$OUT_DIR/$(basename "$1").llama.$2.json"
    if ((BATCHED)); then
        # Room for every stream's prompt and generation at once; one JSON object per level.
        local streams=$(( $(tr ',' '\n' <<<"$LEVELS" | sort -n | tail -n 1) ))
        "${PIN[@]}" "$LLAMA_BATCHED" -m "$1" -t "$THREADS" -c $((streams * (PP + TG) + 16)) -b 2048 -ub 512 \
            -npp "$PP" -ntg "$TG" -npl "$LEVELS" --output-format jsonl >"$out.raw" 2>"$out.log" \
            || die "llama-batched-bench failed on $1, see $out.log"
        grep '^{' "$out.raw" >"$out" || die "no results from llama-batched-bench, see $out.raw"
        return
    fi
    # shellcheck disable=SC2086 # a list of options
    "${PIN[@]}" "$LLAMA_BENCH" -m "$1" -t "$THREADS" -p "$PP" -n "$TG" -r 1 -o json ${LLAMA_BENCH_ARGS:-} >"$out" \
        2>"$out.log" || die "llama-bench failed on $1, see $out.log"
}
run_ik() { # file round
    local out
    out="$OUT_DIR/$(basename "$1").ik.$2.json"
    # shellcheck disable=SC2086 # a list of options
    LD_LIBRARY_PATH="$(dirname "$IK_LLAMA_BENCH")" "${PIN[@]}" "$IK_LLAMA_BENCH" -m "$1" \
        -t "$THREADS" -p "$PP" -n "$TG" -r 1 -o json ${IK_ARGS:--rtr 1} >"$out" 2>"$out.log" \
        || die "ik_llama.cpp's llama-bench failed on $1, see $out.log"
}
run_ferrum() { # file round
    local out
    out="$OUT_DIR/$(basename "$1").ferrum.$2.json"
    local extra=()
    ((BATCHED)) && extra=(--concurrency "$LEVELS")
    "${FERRUM[@]}" bench "$1" --pp "$PP" --tg "$TG" --reps 1 "${extra[@]}" --json >"$out" \
        2>"$out.log" || die "ferrum bench failed on $1, see $out.log"
}
# A native build that faults here (a VM that lists an extension it does not run) gives way to
# one with the extensions named, and that to the AVX2 one, said aloud.
use_build() {
    BUILD="$1"
    LLAMA_BENCH="$(build_llamacpp)/llama-bench"
    LLAMA_BATCHED="$(dirname "$LLAMA_BENCH")/llama-batched-bench"
    LD_LIBRARY_PATH="$(dirname "$LLAMA_BENCH")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    LLAMACPP_FLAGS="$(flags_of "$LLAMA_BENCH")"
}
smoke() { "$LLAMA_BENCH" -m "${FILES[0]}" -t "$THREADS" -p 8 -n 0 -r 1 >"$OUT_DIR/smoke.log" 2>&1; }
if [[ "$ISA" == native && -z "${LLAMA_BENCH_GIVEN:-}" && ${#FILES[@]} -gt 0 ]] && ! smoke; then
    if [[ "$(uname -m)" == x86_64 && -z "${LLAMACPP_CMAKE_FLAGS:-}" ]]; then
        log "the GGML_NATIVE llama.cpp build fails here (see $OUT_DIR/smoke.log): trying the extensions one by one, AMX off"
        use_build explicit
    fi
    if ! smoke; then
        log "the native llama.cpp build fails here (see $OUT_DIR/smoke.log): using the AVX2 one, ferrum on AVX2 too"
        ISA=avx2
        export FERRUM_AVXVNNI=0
        use_build avx2
    fi
fi
export ISA
IK=0
if [[ -n "${IK_LLAMA_BENCH:-}" ]] && ((BATCHED == 0)); then
    [[ -x "$IK_LLAMA_BENCH" ]] || die "IK_LLAMA_BENCH=$IK_LLAMA_BENCH is not executable"
    IK=1
    IK_FLAGS="$(cat "$(dirname "$(dirname "$IK_LLAMA_BENCH")").flags" 2>/dev/null || echo "-DGGML_NATIVE=ON")"
    export IK_FLAGS IK_ARGS="${IK_ARGS:--rtr 1}"
fi
export IK
for f in "${FILES[@]}"; do
    for ((r = 1; r <= ROUNDS; r++)); do
        log "$(basename "$f"): round $r/$ROUNDS"
        # The engines take turns at going first (and, with three, second).
        if ((IK)); then
            case $((r % 3)) in
                1) run_llama "$f" "$r"; run_ik "$f" "$r"; run_ferrum "$f" "$r" ;;
                2) run_ik "$f" "$r"; run_ferrum "$f" "$r"; run_llama "$f" "$r" ;;
                0) run_ferrum "$f" "$r"; run_llama "$f" "$r"; run_ik "$f" "$r" ;;
            esac
        elif ((r % 2)); then
            run_llama "$f" "$r"; run_ferrum "$f" "$r"
        else
            run_ferrum "$f" "$r"; run_llama "$f" "$r"
        fi
    done
done

# --- table --------------------------------------------------------------------------------
CPU="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//' || true)"
REV="$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo '?')"
if ((BATCHED)); then
    "$PYTHON" - "$OUT_DIR" "$ROUNDS" "$PP" "$TG" "$THREADS" "${CPU:-unknown CPU}" "$REV" \
        "${FILES[@]}" <<'EOF' | tee "$OUT_DIR/results.md"
import json, os, statistics, sys, datetime, platform

out_dir, rounds, pp, tg, threads, cpu, rev = sys.argv[1:8]
rounds = int(rounds)
print(f"## bench-vs-llamacpp --batched, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}")
print()
print(f"- machine: {platform.machine()}, {cpu}, {os.cpu_count()} logical CPUs; {threads} threads each")
print(f"- llama.cpp: llama-batched-bench -npp {pp} -ntg {tg} (S_TG: every stream decodes in lockstep)")
print(f"- ferrum: ferrum bench --concurrency --pp {pp} --tg {tg} --reps 1 (git {rev}; decode rate "
      "while every stream decodes)")
print(f"- {rounds} alternating rounds; medians over rounds; × one and ferrum / llama.cpp are "
      "medians of the per-round ratios")
print()
print("| file | streams | llama.cpp t/s | × one | ferrum t/s | × one | ferrum / llama.cpp |")
print("|---|--:|--:|--:|--:|--:|--:|")
med = lambda xs: statistics.median(xs) if xs else float("nan")
for f in sys.argv[8:]:
    name = os.path.basename(f)
    per = {}  # streams -> (llama, ferrum, the round's one-stream pair) per round
    for r in range(1, rounds + 1):
        with open(f"{out_dir}/{name}.llama.{r}.json") as fh:
            llama = {j["pl"]: j["speed_tg"] for j in map(json.loads, fh) if j.get("pl")}
        with open(f"{out_dir}/{name}.ferrum.{r}.json") as fh:
            ferrum = {l["streams"]: l["decode_tok_s"] for l in json.load(fh)["levels"]}
        one = (llama.get(1), ferrum.get(1))
        for s in sorted(set(llama) & set(ferrum)):
            per.setdefault(s, []).append((llama[s], ferrum[s], one))
    for s, rows in sorted(per.items()):
        ok = [x for x in rows if x[1] is not None]
        l = med([x[0] for x in rows])
        fe = med([x[1] for x in ok])
        lx = med([x[0] / x[2][0] for x in rows if x[2][0]])
        fx = med([x[1] / x[2][1] for x in ok if x[2][1]])
        rat = med([x[1] / x[0] for x in ok if x[0]])
        print(f"| {name} | {s} | {l:.1f} | {lx:.2f} | {fe:.1f} | {fx:.2f} | {rat:.2f} |")
EOF
    exit 0
fi
"$PYTHON" - "$OUT_DIR" "$ROUNDS" "$PP" "$TG" "$THREADS" "${CPU:-unknown CPU}" \
    "$REV" "${FILES[@]}" \
    <<'EOF' | tee "$OUT_DIR/results.md"
import json, os, statistics, sys, datetime, platform

out_dir, rounds, pp, tg, threads, cpu, rev = sys.argv[1:8]
files = sys.argv[8:]
rounds = int(rounds)

def load(path):
    with open(path) as fh:
        return json.load(fh)

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

def fmt(x, spec=".2f"):
    return "n/a" if x is None else format(x, spec)

def gb(n):
    return "n/a" if n is None else f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"

ik = os.environ.get("IK") == "1"
speed, memory = [], []
backend = llama_build = ik_build = None

def bench_rates(rows):
    got = {}
    for t in rows:
        if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0:
            got["pp"] = t["avg_ts"]
        elif t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0:
            got["tg"] = t["avg_ts"]
    return got

for f in files:
    name = os.path.basename(f)
    llama = {"pp": [], "tg": []}
    ferrum = {"pp": [], "tg": []}
    ratios = {"pp": [], "tg": []}
    ikr = {"pp": [], "tg": []}
    ik_ratios = {"pp": [], "tg": []}
    best_ratios = {"pp": [], "tg": []}
    rss, bw, wbpt, bound, wsbound = [], [], [], [], []
    fr = None
    for r in range(1, rounds + 1):
        lj = load(f"{out_dir}/{name}.llama.{r}.json")
        fr = load(f"{out_dir}/{name}.ferrum.{r}.json")
        backend = fr.get("backend", backend)
        for t in lj:
            llama_build = t.get("build_commit", llama_build)
        got = bench_rates(lj)
        ig = {}
        if ik:
            ij = load(f"{out_dir}/{name}.ik.{r}.json")
            for t in ij:
                ik_build = t.get("build_commit", ik_build)
            ig = bench_rates(ij)
        for k in ("pp", "tg"):
            l, x, i = got.get(k), fr.get(f"{k}_tok_s"), ig.get(k)
            llama[k].append(l)
            ferrum[k].append(x)
            ikr[k].append(i)
            if l and x:
                ratios[k].append(x / l)
            if i and x:
                ik_ratios[k].append(x / i)
            if l and i and x:
                best_ratios[k].append(x / max(l, i))
        rss.append(fr.get("peak_rss_bytes"))
        bw.append(fr.get("bandwidth_gb_s"))
        wbpt.append(fr.get("weight_bytes_per_token"))
        b = fr.get("tg_bound_tok_s")
        if b is None and bw[-1] and wbpt[-1]:
            b = bw[-1] * 1e9 / wbpt[-1]
        bound.append(b)
        wsbound.append(fr.get("tg_bound_weight_sized_tok_s"))
    for k, n in (("pp", pp), ("tg", tg)):
        if int(n) == 0:
            continue
        lm, fm = med(llama[k]), med(ferrum[k])
        row = f"| {name} | {k}{n} | {fmt(lm)} | "
        if ik:
            row += f"{fmt(med(ikr[k]))} | "
        row += f"{fmt(fm)} | {fmt(med(ratios[k]), '.3f')} |"
        if ik:
            row += f" {fmt(med(ik_ratios[k]), '.3f')} | {fmt(med(best_ratios[k]), '.3f')} |"
        speed.append(row)
    b = med(bound)
    pct = lambda x: None if (b is None or x is None) else 100 * x / b
    size = fr.get("file_bytes") if fr else None
    if size is None:
        size = os.path.getsize(f)
    r = med(rss)
    wb = med(wsbound)
    memory.append(
        f"| {name} | {gb(size)} | {gb(r)} | {fmt(None if r is None else r / size, '.2f')} "
        f"| {gb(med(wbpt))} | {fmt(med(bw), '.1f')} | {fmt(b, '.1f')} "
        f"| {fmt(pct(med(ferrum['tg'])), '.0f')}% | {fmt(pct(med(llama['tg'])), '.0f')}% "
        f"| {fmt(wb, '.1f')} | {fmt(None if wb is None or med(ferrum['tg']) is None else 100 * med(ferrum['tg']) / wb, '.0f')}% |"
    )

print(f"## bench-vs-llamacpp, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}")
print()
print(f"- machine: {platform.machine()}, {cpu}, {os.cpu_count()} logical CPUs")
extra = os.environ.get("LLAMA_BENCH_ARGS", "")
print(f"- llama.cpp: llama-bench -t {threads} -p {pp} -n {tg} -r 1{' ' + extra if extra else ''} "
      f"(build {llama_build or '?'}, ISA {os.environ.get('ISA', 'native')}"
      f"{': ' + os.environ['LLAMACPP_FLAGS'] if os.environ.get('LLAMACPP_FLAGS') else ''})")
if ik:
    print(f"- ik_llama.cpp: llama-bench -t {threads} -p {pp} -n {tg} -r 1 "
          f"{os.environ.get('IK_ARGS', '')} (build {ik_build or '?'}, "
          f"{os.environ.get('IK_FLAGS', '')})")
print(f"- ferrum: ferrum bench --pp {pp} --tg {tg} --reps 1, {backend or '?'} (git {rev})")
print(f"- {rounds} alternating rounds per file; medians over rounds; the ratio is the median "
      "of the per-round ratios (ferrum / the other engine, > 1 means ferrum is faster)")
print()
if ik:
    print("| file | test | llama.cpp t/s | ik_llama.cpp t/s | ferrum t/s | ferrum / llama.cpp "
          "| ferrum / ik_llama.cpp | ferrum / the better |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
else:
    print("| file | test | llama.cpp t/s | ferrum t/s | ferrum / llama.cpp |")
    print("|---|---|--:|--:|--:|")
print("\n".join(speed))
print()
print("| file | size | ferrum peak RSS | RSS / size | weight bytes / token | measured GB/s "
      "| tg bound t/s | ferrum tg % of bound | llama.cpp tg % of bound "
      "| bound at a weight-sized buffer t/s | ferrum tg % of it |")
print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
print("\n".join(memory))
EOF
