# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The maintainer's uses: a vLLM git checkout, refresh and bisect."""

import subprocess
import sys
from pathlib import Path

import pytest
from projectkit import (
    INIT,
    KDA,
    PROBE,
    PROBE_TEST,
    Project,
    git,
    in_mount_namespace,
    needs_unshare,
)


@pytest.fixture
def checkout(series: Path, tmp_path: Path) -> Path:
    """A clone of the repository the patches came from, at their base."""
    clone = tmp_path / "checkout"
    git("clone", "--quiet", str(series), str(clone), cwd=tmp_path)
    git("reset", "--quiet", "--hard", "base", cwd=clone)
    return clone


def state(repo: Path) -> tuple[str, str]:
    return (git("rev-parse", "HEAD", cwd=repo), git("status", "--porcelain", cwd=repo))


def subjects(repo: Path, since: str) -> list[str]:
    return git("log", "--reverse", "--format=%s", f"{since}..HEAD", cwd=repo).split(
        "\n"
    )[:-1]


def test_checkout_gets_one_commit_per_patch(project: Project, checkout: Path) -> None:
    result = project.patchset("apply", "--vllm-src", str(checkout))
    assert result.returncode == 0, result.stderr
    assert subjects(checkout, "base") == [
        "[Model] Add a probe module to glm5next",
        "[Model] Touch KDA and the package init",
    ]


def test_checkout_check_mode_leaves_it_alone(project: Project, checkout: Path) -> None:
    before = state(checkout)
    result = project.patchset("apply", "--check", "--vllm-src", str(checkout))
    assert result.returncode == 0, result.stderr
    assert f"would apply vLLM {project.version}'s 2 patches" in result.stdout
    assert state(checkout) == before


@pytest.mark.parametrize(
    "locale",
    [
        {},
        {"LANG": "C.UTF-8", "LANGUAGE": "de"},
        {"LC_ALL": "C.UTF-8", "LANGUAGE": "fr"},
    ],
    ids=["default", "LANGUAGE=de", "LANGUAGE=fr"],
)
def test_checkout_conflict_names_patch_file_and_hunk(
    project: Project, checkout: Path, locale: dict[str, str]
) -> None:
    """In any locale: git's messages, which the tool reads, are English."""
    kda = checkout / KDA
    kda.write_text(kda.read_text().replace("import ", "import\t", 1))
    git("commit", "--quiet", "-am", "upstream moved on", cwd=checkout)
    before = state(checkout)
    result = project.patchset(
        "apply", "--vllm-src", str(checkout), env={**project.env, **locale}
    )
    assert result.returncode == 1
    assert "0002-Model-Touch-KDA-and-the-package-init.patch" in result.stderr
    assert f"{KDA}: hunk #1" in result.stderr
    assert state(checkout) == before
    assert not (checkout / ".git" / "rebase-apply").exists()


def test_half_applied_checkout_is_refused(
    project: Project, checkout: Path, series: Path
) -> None:
    git("fetch", "--quiet", str(series), "HEAD", cwd=checkout)
    git("reset", "--quiet", "--hard", "FETCH_HEAD~1", cwd=checkout)
    before = state(checkout)
    result = project.patchset("apply", "--vllm-src", str(checkout))
    assert result.returncode == 1
    assert "0001-Model-Add-a-probe-module-to-glm5next.patch" in result.stderr
    assert state(checkout) == before


def test_dirty_checkout_is_refused(project: Project, checkout: Path) -> None:
    (checkout / INIT).write_text("# local edit\n")
    result = project.patchset("apply", "--vllm-src", str(checkout))
    assert result.returncode == 1
    assert "has uncommitted changes" in result.stderr
    assert (checkout / INIT).read_text() == "# local edit\n"


def test_a_failed_signing_is_not_a_patch_that_does_not_apply(
    project: Project, checkout: Path
) -> None:
    env = {**project.env, "GIT_CONFIG_COUNT": "2", "GIT_CONFIG_KEY_0": "gpg.program"}
    env.update(GIT_CONFIG_VALUE_0="false", GIT_CONFIG_KEY_1="commit.gpgSign")
    env.update(GIT_CONFIG_VALUE_1="true")
    before = state(checkout)
    result = project.patchset("apply", "--vllm-src", str(checkout), env=env)
    assert result.returncode == 1
    assert "applies, but `git am` could not commit it" in result.stderr
    assert "does not apply" not in result.stderr and "gpg" in result.stderr
    assert state(checkout) == before


@needs_unshare
def test_a_full_temporary_disk_is_said_first(
    project: Project, checkout: Path, tmp_path: Path
) -> None:
    small = tmp_path / "small"
    small.mkdir()
    script = (
        f"mount -t tmpfs -o size=8k tmpfs {small} && TMPDIR={small} "
        f"{sys.executable} scripts/patchset apply --check --vllm-src {checkout}"
    )
    result = in_mount_namespace(script, project.root, project.env)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("patchset: error: no space left on the device")
    assert result.stderr.count("\n") == 1, "one line, not git's every file"


def test_refresh_regenerates_patch_and_overlay(project: Project, work: Path) -> None:
    patch = sorted(project.patches().glob("0001-*.patch"))[0]
    header = patch.read_text().split("\n---\n")[0]
    (work / PROBE).write_text((work / PROBE).read_text().replace("42", "43"))
    result = project.patchset("refresh", "1", "--vllm-src", str(work))
    assert result.returncode == 0, result.stderr
    assert patch.name in result.stdout
    assert patch.read_text().split("\n---\n")[0] == header
    assert "+ANSWER = 43" in patch.read_text()
    assert (project.overlay() / PROBE).read_text().endswith("ANSWER = 43\n")
    checked = project.patchset("check")
    assert checked.returncode == 0, checked.stderr


def test_refresh_conflict_keeps_the_edits(project: Project, work: Path) -> None:
    """An edit to patch 1 that a later patch's context depends on."""
    init = work / INIT
    init.write_text(init.read_text().replace("# probe: patch 1\n", "# edited\n"))
    series_before = [p.read_text() for p in sorted(project.patches().iterdir())]
    result = project.patchset("refresh", "1", "--vllm-src", str(work))
    assert result.returncode == 1
    assert "conflicts with a later patch" in result.stderr
    assert "# edited\n" in init.read_text()
    assert [p.read_text() for p in sorted(project.patches().iterdir())] == (
        series_before
    )


@pytest.mark.parametrize(
    "case, expected",
    [("good", 0), ("test-fails", 1), ("does-not-apply", 125), ("all-skip", 125)],
    ids=["good", "test-fails", "does-not-apply", "all-skip"],
)
def test_bisect_run_verdicts(
    project: Project, work: Path, case: str, expected: int
) -> None:
    git("reset", "--quiet", "--hard", "patchset-base", cwd=work)
    if case == "test-fails":
        for patch in project.patches().glob("0001-*.patch"):
            patch.write_text(patch.read_text().replace("ANSWER == 42", "ANSWER == 41"))
    if case == "all-skip":
        for patch in project.patches().glob("0001-*.patch"):
            skip = "__import__('pytest').skip('no GPU')"
            patch.write_text(patch.read_text().replace("assert ANSWER == 42", skip))
    if case == "does-not-apply":
        (work / KDA).write_text("# upstream rewrote this file\n")
        git("commit", "--quiet", "-am", "rewrite kda", cwd=work)
    result = project.patchset("bisect-run", "--vllm-src", str(work))
    assert result.returncode == expected, result.stdout + result.stderr
    assert state(work)[1] == ""


def test_probe_files_are_in_the_series(project: Project, series: Path) -> None:
    assert (project.overlay() / PROBE_TEST).is_file()
    assert (
        subprocess.run(
            ["git", "-C", str(series), "diff", "--quiet", "base", "HEAD", "--", PROBE],
            check=False,
        ).returncode
        == 1
    )


def test_refresh_refuses_to_overwrite_edited_copies(
    project: Project, work: Path
) -> None:
    """An edit made in vllm_overlay/ instead of the work tree would be lost."""
    overlay = project.overlay() / PROBE
    overlay.write_text(overlay.read_text() + "EDITED_IN_OVERLAY = True\n")
    (work / PROBE).write_text((work / PROBE).read_text().replace("42", "43"))
    result = project.patchset("refresh", "1", "--vllm-src", str(work))
    assert result.returncode == 1
    assert "edited outside the work tree" in result.stderr
    assert str(overlay) in result.stderr
    assert overlay.read_text().endswith("EDITED_IN_OVERLAY = True\n")


def test_refresh_says_what_to_do_with_a_new_commit(
    project: Project, work: Path
) -> None:
    (work / PROBE).write_text((work / PROBE).read_text().replace("42", "44"))
    git("commit", "--quiet", "-am", "tweak the probe", cwd=work)
    series_before = [p.read_text() for p in sorted(project.patches().iterdir())]
    result = project.patchset("refresh", "1", "--vllm-src", str(work))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "1 commit(s) after the series' 2" in result.stderr
    assert "tweak the probe" in result.stderr
    assert "git commit --fixup=" in result.stderr
    assert "git rebase -i --autosquash patchset-base" in result.stderr
    assert "scripts/patchset refresh 3" in result.stderr
    assert [p.read_text() for p in sorted(project.patches().iterdir())] == (
        series_before
    )


def test_worktree_reuses_the_work_tree_it_made(project: Project, work: Path) -> None:
    (work / PROBE).write_text("# an edit in progress\n")
    again = project.patchset("worktree", "--dest", str(work))
    assert again.returncode == 0, again.stderr
    assert f"work tree reused at {work}" in again.stdout
    assert (work / PROBE).read_text() == "# an edit in progress\n"


def edit_patch_body(project: Project) -> list[str]:
    """Change patch 1's message as a change landing from elsewhere would
    (a pull, or a refresh from another work tree); return the series."""
    patch = sorted(project.patches().glob("0001-*.patch"))[0]
    text = patch.read_text()
    patch.write_text(text.replace("\n---\n", "\nA later word.\n---\n", 1))
    return [p.read_text() for p in sorted(project.patches().iterdir())]


def test_worktree_refuses_a_work_tree_of_an_older_series(
    project: Project, work: Path
) -> None:
    edit_patch_body(project)
    again = project.patchset("worktree", "--dest", str(work))
    assert again.returncode == 1
    assert "Traceback" not in again.stderr
    assert "changed after this work tree was made" in again.stderr


def test_refresh_refuses_a_work_tree_of_an_older_series(
    project: Project, work: Path
) -> None:
    (work / PROBE).write_text((work / PROBE).read_text().replace("42", "43"))
    series_before = edit_patch_body(project)
    result = project.patchset("refresh", "1", "--vllm-src", str(work))
    assert result.returncode == 1
    assert "changed after this work tree was made" in result.stderr
    assert [p.read_text() for p in sorted(project.patches().iterdir())] == (
        series_before
    )


def test_refresh_keeps_the_work_tree_current(project: Project, work: Path) -> None:
    for answer in ("43", "44"):
        text = (work / PROBE).read_text()
        (work / PROBE).write_text(text.replace(str(int(answer) - 1), answer))
        result = project.patchset("refresh", "1", "--vllm-src", str(work))
        assert result.returncode == 0, result.stderr
    assert (project.overlay() / PROBE).read_text().endswith("ANSWER = 44\n")
