# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests of the test-tethering checker, each on a small repository in a
temporary directory, plus one run over this repository's own ci/ and tests/."""

from pathlib import Path
from typing import Any

import pytest
import yaml
from projectkit import declared_versions, require_series

from patchset_tool import bases, tethering

REPO = Path(__file__).resolve().parents[2]

A = "tests/models/foo/test_a.py"
B = "tests/models/bar/test_b.py"
TP = "tests/models/foo/test_x_tp.py"
BASE_FILES = {
    A: "",
    B: "",
    "tests/models/foo/conftest.py": "",
    "tests/models/foo/__init__.py": "",
    "tests/models/helper.py": "",
}


def step(*commands: str, **extra: Any) -> dict[str, Any]:
    return {"label": "x", "key": "x", "commands": list(commands), **extra}


def make_repo(
    root: Path,
    files: dict[str, str],
    steps: list[dict[str, Any]],
    allowlist: str | None,
) -> Path | None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "ci" / "test_areas").mkdir(parents=True)
    (root / "ci" / "test_areas" / "area.yaml").write_text(
        yaml.safe_dump({"group": "g", "steps": steps})
    )
    if allowlist is None:
        return None
    path = root / "ci" / "allow.yaml"
    path.write_text(allowlist)
    return path


def run_check(root: Path, allowlist: Path | None) -> list[str]:
    return tethering.check(
        root / "tests", [root / "ci" / "test_areas"], allowlist, root / "tests"
    )


CASES = [
    pytest.param(
        {}, [step("pytest -v -s models")], None, [], id="directory-selects-all"
    ),
    pytest.param(
        {}, [step("pytest -v -s models/foo")], None, [B], id="file-no-step-selects"
    ),
    pytest.param(
        {},
        [step("pytest -v -s models/foo/test_a.py models/bar/test_b.py")],
        None,
        [],
        id="several-paths-one-command",
    ),
    pytest.param(
        {},
        [step(f"pytest -v -s models --ignore={A[6:]}")],
        None,
        [A],
        id="removed-by-ignore",
    ),
    pytest.param(
        {},
        [step("pytest models --ignore models/bar")],
        None,
        [B],
        id="removed-by-ignore-separate-value",
    ),
    pytest.param(
        {TP: ""},
        [step("pytest models --ignore-glob=*_tp.py")],
        None,
        [TP],
        id="removed-by-ignore-glob",
    ),
    pytest.param(
        {},
        [step("pytest models --deselect models/foo/test_a.py::test_one")],
        None,
        [],
        id="deselect-node-id-keeps-file",
    ),
    pytest.param(
        {},
        [step("pytest models --deselect models/foo/test_a.py")],
        None,
        [A],
        id="deselect-bare-path-removes-file",
    ),
    pytest.param(
        {},
        [step("pytest models -k 'not slow' -m 'not gpu'")],
        None,
        [],
        id="k-and-m-keep-files",
    ),
    pytest.param(
        {},
        [step("pytest models/foo/test_*.py models/b*")],
        None,
        [],
        id="positional-globs",
    ),
    pytest.param(
        {}, [step("pytest tests/models")], None, [A, B], id="path-wrong-for-workdir"
    ),
    pytest.param(
        {},
        [step("cd /vllm-workspace && pytest tests/models")],
        None,
        [],
        id="cd-absolute",
    ),
    pytest.param(
        {},
        [step("cd models", "pytest foo bar")],
        None,
        [],
        id="cd-persists-across-step-commands",
    ),
    pytest.param(
        {},
        [step("(cd models/foo && pytest .) && pytest bar")],
        None,
        [B],
        id="cd-in-subshell-does-not-leak",
    ),
    pytest.param(
        {},
        [step("pytest -v -s tests/models", working_dir="/vllm-workspace")],
        None,
        [],
        id="step-working-dir",
    ),
    pytest.param(
        {},
        [step("pytest -v -s models/foo", working_dir=".")],
        None,
        [A, B],
        id="relative-working-dir-is-checkout",
    ),
    pytest.param(
        {"ci/runner.sh": 'docker run img bash -c "$1"\n'},
        [
            step(
                "bash /vllm-workspace/ci/runner.sh 'cd tests && "
                'pytest models/foo\' "pytest tests/models/bar"'
            )
        ],
        None,
        [],
        id="runner-script-command-strings",
    ),
    pytest.param(
        {},
        [step("find models -name 'test_*.py' | sort | xargs -n 1 pytest -v -s")],
        None,
        [],
        id="find-xargs-pytest",
    ),
    pytest.param(
        {},
        [step("find models -name 'test_*.py' -not -name 'test_b.py' | xargs pytest")],
        None,
        [B],
        id="find-not-name",
    ),
    pytest.param(
        {},
        [step("find models -maxdepth 1 -name 'test_*.py' | xargs pytest")],
        None,
        [A, B],
        id="find-maxdepth",
    ),
    pytest.param(
        {},
        [step("find models -name 'test_*.py' | wc -l")],
        None,
        [A, B],
        id="find-not-fed-to-pytest",
    ),
    pytest.param(
        {},
        [step("find models -name 'test_*.py' -exec pytest {} +")],
        None,
        [],
        id="find-exec-pytest",
    ),
    pytest.param(
        {
            "tests/run_models.sh": "#!/bin/bash\nset -e\nT=bar\n"
            "cd models\npytest -v -s foo \\\n  $T\n"
        },
        [step("bash run_models.sh")],
        None,
        [],
        id="bash-script",
    ),
    pytest.param(
        {"ci/run.sh": "pytest -v -s models/foo\n"},
        [step("bash /vllm-workspace/ci/run.sh")],
        None,
        [B],
        id="bash-script-absolute-path",
    ),
    pytest.param(
        {"tests/run_models.sh": "echo pytest models\n"},
        [step("bash run_models.sh")],
        None,
        [A, B],
        id="bash-script-without-pytest",
    ),
    pytest.param(
        {}, [step("bash -c 'pytest models/foo models/bar'")], None, [], id="bash-dash-c"
    ),
    pytest.param(
        {},
        [step("python3 -m pytest models/foo", "python -m compileall models/bar")],
        None,
        [B],
        id="python-m-pytest",
    ),
    pytest.param(
        {},
        [step("VLLM_X=1 timeout 600 pytest models/foo", "env FOO=1 pytest models/bar")],
        None,
        [],
        id="env-and-timeout-wrappers",
    ),
    pytest.param(
        {}, [step("echo pytest models")], None, [A, B], id="echo-is-not-pytest"
    ),
    pytest.param(
        {},
        [
            step(
                "pytest models/foo",
                mirror={"amd": {"label": "amd", "commands": ["pytest models/bar"]}},
            )
        ],
        None,
        [],
        id="mirror-commands",
    ),
    pytest.param(
        {},
        [{"group": "inner", "steps": [step("pytest models")]}],
        None,
        [],
        id="nested-group",
    ),
    pytest.param(
        {},
        [step("pytest models/foo")],
        f"{B}: needs 8 GPUs\n",
        [],
        id="allowlist-entry-with-reason",
    ),
    pytest.param(
        {},
        [step("pytest models/foo")],
        f"{B}:\n",
        [f"{B} has no reason", f"{B} is not run"],
        id="allowlist-entry-without-reason",
    ),
    pytest.param(
        {},
        [step("pytest models/foo")],
        f"{B}: '  '\n",
        [f"{B} has no reason", f"{B} is not run"],
        id="allowlist-entry-blank-reason",
    ),
    pytest.param(
        {},
        [step("pytest models")],
        f"{B}: slow\n",
        [f"{B} is allowlisted but now tethered"],
        id="allowlist-entry-now-tethered",
    ),
    pytest.param(
        {},
        [step("pytest models")],
        "tests/gone/test_x.py: old\n",
        ["tests/gone/test_x.py is allowlisted but does not exist"],
        id="allowlist-entry-file-gone",
    ),
    pytest.param(
        {},
        [step("pytest models")],
        "- just a list\n",
        ["must be a mapping"],
        id="allowlist-not-a-mapping",
    ),
]


@pytest.mark.parametrize("files, steps, allowlist, expected", CASES)
def test_check(
    tmp_path: Path,
    files: dict[str, str],
    steps: list[dict[str, Any]],
    allowlist: str | None,
    expected: list[str],
) -> None:
    allow_path = make_repo(tmp_path, {**BASE_FILES, **files}, steps, allowlist)
    messages = run_check(tmp_path, allow_path)
    assert len(messages) == len(expected), messages
    for fragment in expected:
        assert sum(fragment in m for m in messages) == 1, (fragment, messages)


def test_untethered_message_names_file(tmp_path: Path) -> None:
    make_repo(tmp_path, BASE_FILES, [step("pytest models/foo")], None)
    [message] = run_check(tmp_path, None)
    assert message.startswith(f"error: {B} is not run by any CI step")


def test_helpers_are_not_test_modules(tmp_path: Path) -> None:
    make_repo(tmp_path, BASE_FILES, [step("pytest models")], None)
    found = tethering.test_modules(tmp_path / "tests")
    assert [p.relative_to(tmp_path).as_posix() for p in found] == [B, A]


def test_bad_yaml_is_an_error(tmp_path: Path) -> None:
    make_repo(tmp_path, BASE_FILES, [step("pytest models")], None)
    (tmp_path / "ci" / "test_areas" / "broken.yaml").write_text("steps: [\n")
    messages = run_check(tmp_path, None)
    assert len(messages) == 1 and "broken.yaml" in messages[0]


def test_main_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    allow = make_repo(tmp_path, BASE_FILES, [step("pytest models/foo")], f"{B}:\n")
    assert allow is not None
    argv = [
        "--tests",
        str(tmp_path / "tests"),
        "--steps",
        str(tmp_path / "ci" / "test_areas"),
    ]
    assert tethering.main(argv) == 1
    assert f"{B} is not run" in capsys.readouterr().out
    assert tethering.main([*argv, "--allowlist", str(allow)]) == 1
    allow.write_text(f"{B}: run by hand on 8 GPUs\n")
    assert tethering.main([*argv, "--allowlist", str(allow)]) == 0


def test_this_repository_is_tethered() -> None:
    allowlist = REPO / "ci" / "tethering-allowlist.yaml"
    messages = tethering.check(
        REPO / "tests",
        [REPO / "ci" / "test_areas"],
        allowlist if allowlist.exists() else None,
        REPO / "tests",
    )
    assert messages == []


@pytest.mark.parametrize("version", declared_versions())
def test_the_model_tests_of_each_base_are_tethered(version: str) -> None:
    """The test files a base's series adds (in its overlay's tests/) are
    run by a step of ci/test_areas/, as upstream's checkout would run them."""
    require_series(version)
    tests = bases.get_base(version).overlay / "tests"
    allowlist = REPO / "ci" / "tethering-allowlist.yaml"
    assert tethering.test_modules(tests), f"{tests}: no test module"
    messages = tethering.check(
        tests,
        [REPO / "ci" / "test_areas"],
        allowlist if allowlist.exists() else None,
        tests,
    )
    assert messages == []
