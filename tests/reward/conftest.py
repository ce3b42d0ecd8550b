from __future__ import annotations

import pytest

from engines.models.model_builder import make_model


@pytest.fixture(scope="session")
def judge_model(tmp_path_factory):
    """A tiny random judge checkpoint, built once per test session."""
    return make_model("qwen3", "tiny", str(tmp_path_factory.mktemp("j") / "judge"), seed=3)
