"""Shared fixtures: tiny random models built on the fly, once per test session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_models import ARCHS, build_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny model directory per supported architecture (mistral's is sharded)."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(str(root / arch), arch, seed=i,
                              max_shard_size="100KB" if arch == "mistral" else None)
            for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]
