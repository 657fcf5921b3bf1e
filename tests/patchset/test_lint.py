# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""lint type-checks each overlay file in the group that its own base's
tools/pre_commit/mypy.py gives it, so a test upstream checks at
`follow_imports = "silent"` is checked so here too."""

import pytest

from patchset_tool import bases, lint

GLM_TEST = "tests/models/glm5next/test_fp8_kv_cache.py"
ATTENTION_TEST = "tests/v1/attention/test_flashmla_nope_sm90_backend_selection.py"
CODE = "vllm/platforms/cuda.py"


@pytest.mark.parametrize(
    ("version", "glm_group"),
    [
        pytest.param("0.34.0", "", id="0.34.0-model-tests-silent"),
        pytest.param("0.33.0", "tests/models", id="0.33.0-model-tests-skip"),
    ],
)
def test_overlay_files_take_their_bases_own_mypy_groups(
    version: str, glm_group: str
) -> None:
    base = bases.get_base(version)
    groups = lint.upstream_mypy_groups(base, [CODE, GLM_TEST, ATTENTION_TEST])
    assert CODE in groups[""]
    assert ATTENTION_TEST in groups[""]
    assert GLM_TEST in groups[glm_group]
    assert all(groups.values())
