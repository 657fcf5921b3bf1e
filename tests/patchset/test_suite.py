# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The verification suite (tests/models/glm5next, one copy for every base):
how `patchset test` runs it and what `patchset gpu` stages from it."""

import ast
import os
import subprocess
from pathlib import Path

import pytest

from patchset_tool import bases, envmgr, gpu_stage, paths, runner, testcmd
from patchset_tool.apply import STAMP
from patchset_tool.junit import read_node_list
from patchset_tool.series import Series


@pytest.mark.parametrize("base", bases.load_bases(), ids=lambda b: b.version)
def test_gpu_stages_the_suites_kernel_tests(base: bases.Base) -> None:
    """One copy for every base: the suite's kernel test, not a base's."""
    staged = gpu_stage.gpu_test_files(Series.load(base))
    assert paths.SUITE / "test_fp8_ds_mla_kernels.py" in staged
    assert len({test.name for test in staged}) == len(staged)


def test_suite_expected_skips_name_tests_of_the_suite() -> None:
    skips = read_node_list(paths.SUITE_EXPECTED_SKIPS)
    assert skips
    for node in skips:
        path, name = node.split("::", 1)
        assert (paths.REPO / path).parent == paths.SUITE, node
        tree = ast.parse((paths.REPO / path).read_text())
        functions = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}
        assert name.split("[", 1)[0] in functions, node


def test_suite_env_names_the_pristine_install_and_the_patched_tree(
    primary_base: bases.Base,
) -> None:
    python = Path(envmgr.env_python(primary_base) or "")
    env = runner.suite_env(python, primary_base)
    pristine = Path(env[runner.SUITE_PRISTINE_VAR])
    patched = Path(env[runner.SUITE_PATCHED_VAR])
    assert (pristine / "vllm" / "__init__.py").is_file()
    assert not (pristine / STAMP).exists()
    assert patched == primary_base.patched_tree()
    caches = {
        env[f"{v}_CACHE"] for v in (runner.SUITE_PRISTINE_VAR, runner.SUITE_PATCHED_VAR)
    }
    assert len(caches) == 2


SUITE_PROBE = """
import os
from pathlib import Path

import pytest


def test_both_trees_are_named():
    for var in ("{pristine}", "{patched}"):
        assert os.environ[var]
    assert (Path(os.environ["{pristine}"]) / "vllm" / "__init__.py").is_file()


def test_needs_a_gpu():
    pytest.skip("needs a GPU")


def test_skips_for_no_listed_reason():
    pytest.skip("not listed")
"""


def test_suite_part_holds_the_suite_to_its_expected_skips(
    primary_base: bases.Base,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The part runs the suite with both trees named; a skip the suite's
    list does not name fails it."""
    suite = tmp_path / "tests" / "models" / "glm5next"
    suite.mkdir(parents=True)
    (suite / "test_probe.py").write_text(
        SUITE_PROBE.format(
            pristine=runner.SUITE_PRISTINE_VAR, patched=runner.SUITE_PATCHED_VAR
        )
    )
    skips = suite / "expected-skips.txt"
    skips.write_text("tests/models/glm5next/test_probe.py::test_needs_a_gpu\n")
    monkeypatch.setattr(paths, "REPO", tmp_path)
    monkeypatch.setattr(paths, "SUITE", suite)
    monkeypatch.setattr(paths, "SUITE_EXPECTED_SKIPS", skips)
    part = testcmd.Part("suite")
    part.log = tmp_path / "suite.log"
    python = Path(envmgr.env_python(primary_base) or "")
    testcmd.verification_suite(part, python, primary_base)
    assert (part.passed, part.failed, part.skipped) == (1, 0, 2)
    unlisted = "tests/models/glm5next/test_probe.py::test_skips_for_no_listed_reason"
    assert part.problems == [f"skipped, not listed: {unlisted}"]


def test_reports_take_their_helpers_from_the_suite(
    tmp_path: Path, primary_base: bases.Base
) -> None:
    """`coverage` and `capacity` build GLM-5.3-Flash with the suite's public
    helpers, imported by name where `runner.run(..., suite=True)` runs them,
    not with private names of a series' test files (which a series may
    drop)."""
    python = Path(envmgr.env_python(primary_base) or "")
    env = runner.tree_env(python, primary_base, pristine=True, suite=True)
    assert str(paths.SUITE) in env["PYTHONPATH"].split(os.pathsep)
    assert str(paths.SUITE) not in runner.tree_env(python, primary_base, True)[
        "PYTHONPATH"
    ].split(os.pathsep)
    probe = (
        "import sys; from pathlib import Path\n"
        "from patchset_tool.reports import capacity, coverage\n"
        "helpers = coverage.load_helpers()\n"
        "assert capacity.load_helpers is coverage.load_helpers\n"
        "assert helpers.load_glm5_flash_config()['architectures']\n"
        "model = helpers.write_model_dir(Path(sys.argv[1]), {'quant_method': 'fp8'})\n"
        "assert (model / 'config.json').is_file()\n"
        "print(helpers.__file__)\n"
    )
    done = subprocess.run(
        [str(python), "-c", probe, str(tmp_path / "model")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == paths.SUITE / "glm5next_verify.py"
