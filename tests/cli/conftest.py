"""Shared bits of the command-line tests: the binary and model under test (set by
crates/ferrum-cli/tests/openai_client.rs, or by hand as FERRUM_BIN / FERRUM_MODEL)."""

import os

import pytest


@pytest.fixture(scope="session")
def ferrum():
    return os.environ["FERRUM_BIN"]


@pytest.fixture(scope="session")
def model():
    return os.environ["FERRUM_MODEL"]
