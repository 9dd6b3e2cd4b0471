#!/usr/bin/env bash
# The test command (README, CI): fetch the real model and tokenizer vectors the tests use
# (idempotent; pip only), then run every test of the workspace. Tests are built optimised
# ([profile.test] in Cargo.toml) so the real-model ones take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-test-assets.sh >/dev/null
cargo test --workspace "$@"
