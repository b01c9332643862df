"""Fixtures for the model examples, with no cleanup code at all.

Each ``gpu`` test runs in its own spawned child: whatever a runner holds (weights, the
caching allocator's pool, an engine's processes) ends with that process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the model examples need `pip install -e .[models]`")

import runners  # noqa: E402 - after the skip: it needs transformers' environment
import tiny  # noqa: E402

PROMPTS = ["the quick brown fox", "hello world from", "one two three"]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny.model_dir()


@pytest.fixture
def example_prompts() -> list[str]:
    return list(PROMPTS)


@pytest.fixture
def hf_runner() -> type[runners.HfRunner]:
    return runners.HfRunner


@pytest.fixture
def vllm_runner() -> type[runners.VllmRunner]:
    pytest.importorskip("vllm", reason="vLLM is not installed (see examples/models/README.md)")
    return runners.VllmRunner
