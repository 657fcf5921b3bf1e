# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the GLM-5.3-Flash verification suite (helpers in
`glm5next_verify`)."""

from pathlib import Path
from typing import Any

import glm5next_verify as verify
import pytest


@pytest.fixture(scope="session")
def glm5_flash_config() -> dict[str, Any]:
    return verify.load_glm5_flash_config()


@pytest.fixture
def glm5_flash_model_dir(tmp_path: Path) -> Path:
    """A model directory holding GLM-5.3-Flash's BF16 config.json."""
    return verify.write_model_dir(tmp_path / "glm-5.3-flash")


@pytest.fixture
def gpu_stubs(monkeypatch: pytest.MonkeyPatch) -> None:
    verify.stub_gpu_only_parts(monkeypatch)
