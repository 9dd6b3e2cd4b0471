#!/usr/bin/env bash
# The test command (README, CI): fetch the real model and tokenizer vectors the tests use
# (idempotent; pip only), then run every test of the workspace. Tests are built optimised
# ([profile.test] in Cargo.toml) so the real-model ones take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-test-assets.sh >/dev/null
# Where lavapipe is installed (the fetch above installs it as root), the Vulkan backend's tests
# must find a device: a broken driver fails them instead of skipping them.
if ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
    export FERRUM_REQUIRE_VULKAN=1
fi
cargo test --workspace "$@"
