# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Several bases: bases.toml, `check` across the bases' series, porting a
series with `rebase --onto`, and the release `bisect-run` picks."""

from pathlib import Path

import pytest
from projectkit import (
    PROBE_TEST,
    SPDX,
    Project,
    build_history,
    declare_bases,
    git,
    two_patches,
    write_series,
    write_tree,
)

from patchset_tool import bases, gitutil

OLD, NEW = "1.0.0", "1.1.0"
MOD = "vllm/models/glm5next/mod.py"
HELPER = "vllm/models/glm5next/helper.py"
MOD_TEST = "tests/models/glm5next/test_mod.py"
EXTRA = "vllm/models/glm5next/extra.py"
LINE_5 = 7
"""The line of `x05 = 5` in MOD (after the two SPDX lines)."""


def release(where: Path, x05: str = "x05 = 5", x25: str = "x25 = 25") -> Path:
    """A tiny release tree: MOD holds 30 numbered lines."""
    lines = [f"x{n:02d} = {n}" for n in range(1, 31)]
    lines[4], lines[24] = x05, x25
    return write_tree(where, {MOD: SPDX + "\n".join(lines) + "\n"})


def port_series() -> list[tuple[str, dict]]:
    """Patch 1 changes line 5 of MOD and adds its test; patch 2 adds a
    helper module."""
    return [
        (
            "[Model] Change the fifth line",
            {
                MOD: lambda old: old.replace("x05 = 5\n", "x05 = 50\n"),
                MOD_TEST: lambda _: SPDX + "def test_mod():\n    assert True\n",
            },
        ),
        ("[Model] Add a helper", {HELPER: lambda _: SPDX + "HELP = 1\n"}),
    ]


@pytest.fixture
def ported(project: Project, tmp_path: Path) -> Project:
    """A project declaring OLD (primary, with the series) and NEW (without
    one yet), and a release history holding both in its cache."""
    declare_bases(project, [OLD, NEW])
    old = release(tmp_path / "old")
    write_series(project, old, port_series(), tmp_path / "series-old", OLD)
    return project


def with_history(project: Project, tmp_path: Path, new_x05: str) -> None:
    build_history(
        project.cache / "src" / f"vllm-history-{OLD}-{NEW}",
        [
            (OLD, release(tmp_path / "rel-old")),
            (NEW, release(tmp_path / "rel-new", x05=new_x05, x25="x25 = 2500")),
        ],
    )


def subjects(repo: Path, since: str) -> list[str]:
    return git("log", "--reverse", "--format=%s", f"{since}..HEAD", cwd=repo).split(
        "\n"
    )[:-1]


# bases.toml


@pytest.mark.parametrize(
    "text, message",
    [
        (
            (
                '[[base]]\nversion = "1.0.0"\ncommit = "abc"\nprimary = true\n\n'
                '[[base]]\nversion = "1.1.0"\ncommit = "def"\nprimary = true\n'
            ),
            "exactly one base must say `primary = true` (found 2)",
        ),
        ('[[base]\nversion = "1.0.0"\n', "bases.toml: cannot read it"),
        ('[[base]]\nversion = "1.0.0"\nprimary = true\n', "cannot read the bases"),
    ],
    ids=["two-primaries", "not-toml", "base-without-commit"],
)
@pytest.mark.parametrize("command", [["check"], ["env"], ["apply", "--check"]])
def test_bad_declaration_is_a_clear_error(
    project: Project, text: str, message: str, command: list[str]
) -> None:
    (project.root / "bases.toml").write_text(text)
    result = project.patchset(*command)
    assert result.returncode == 1, result.stdout + result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["apply", "--check", "--base", "9.9.9"],
        ["env", "--base", "9.9.9"],
        ["worktree", "--base", "9.9.9"],
        ["rebase", "--onto", "9.9.9"],
    ],
    ids=["apply", "env", "worktree", "rebase"],
)
def test_unknown_base_is_refused(project: Project, command: list[str]) -> None:
    result = project.patchset(*command)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"no base 9.9.9 in bases.toml; declared: {project.version}" in (
        result.stderr
    )
    assert not (project.root / "build").exists()


# check across the bases


def test_check_names_the_base_whose_series_differs(
    project: Project, pristine_site: Path, tmp_path: Path
) -> None:
    declare_bases(project, [OLD, NEW])
    extra = (
        "[Model] Only the newer release needs this",
        {EXTRA: lambda _: SPDX + "EXTRA = 1\n"},
    )
    write_series(project, pristine_site, two_patches(), tmp_path / "a", OLD)
    write_series(project, pristine_site, [*two_patches(), extra], tmp_path / "b", NEW)
    result = project.patchset("check")
    assert result.returncode == 1, result.stdout
    assert f"vLLM {NEW} carries" in result.stderr
    assert extra[0] in result.stderr
    assert "declare an intended difference in bases.toml" in result.stderr

    declare_bases(project, [OLD, NEW], {extra[0]: "1.1.0 moved the probe"})
    result = project.patchset("check")
    assert result.returncode == 0, result.stderr
    assert "2 bases carry the same 2 patches by subject, in order" in result.stdout


def test_check_fails_when_a_file_declared_the_same_drifts(
    project: Project, pristine_site: Path, tmp_path: Path
) -> None:
    declare_bases(project, [OLD, NEW], same=[PROBE_TEST])
    write_series(project, pristine_site, two_patches(), tmp_path / "a", OLD)
    write_series(project, pristine_site, two_patches(), tmp_path / "b", NEW)
    result = project.patchset("check")
    assert result.returncode == 0, result.stderr
    assert "1 files declared the same are one file in every base" in result.stdout

    drifted = two_patches()
    drifted[0][1][PROBE_TEST] = lambda _: SPDX + "def test_probe():\n    pass\n"
    write_series(project, pristine_site, drifted, tmp_path / "c", NEW)
    result = project.patchset("check")
    assert result.returncode == 1, result.stdout
    assert f"{PROBE_TEST}: declared the same in every base" in result.stderr
    assert f"vLLM {OLD} " in result.stderr and f"vLLM {NEW} " in result.stderr


def test_check_needs_every_declared_base_to_have_a_series(
    ported: Project,
) -> None:
    result = ported.patchset("check")
    assert result.returncode == 1
    assert f"{ported.series_file(NEW)}: no series file" in result.stderr


# rebase --onto


def test_rebase_clean_merge_writes_one_commit_per_patch(
    ported: Project, tmp_path: Path
) -> None:
    with_history(ported, tmp_path, new_x05="x05 = 5")
    result = ported.patchset("rebase", "--onto", NEW)
    assert result.returncode == 0, result.stderr
    work = ported.build(NEW) / "work"
    assert f"merged vLLM {OLD}'s 2 patches onto v{NEW} in {work}" in result.stdout
    assert subjects(work, f"v{NEW}") == [s for s, _ in port_series()]
    assert git("rev-parse", "patchset-base", cwd=work) == git(
        "rev-parse", f"v{NEW}^{{commit}}", cwd=work
    )
    assert git("branch", "--show-current", cwd=work).strip() == f"glm5next-{NEW}"
    mod = (work / MOD).read_text()
    assert "x05 = 50\n" in mod and "x25 = 2500\n" in mod
    assert not ported.series_file(NEW).exists()


def test_rebase_conflict_stops_then_refresh_writes_the_new_series(
    ported: Project, tmp_path: Path
) -> None:
    with_history(ported, tmp_path, new_x05="x05 = 5  # upstream")
    result = ported.patchset("rebase", "--onto", NEW, "--from", OLD)
    assert result.returncode == 1, result.stdout
    assert "0001-Model-Change-the-fifth-line.patch does not merge onto" in (
        result.stderr
    )
    assert f"{MOD}: 1 conflicting hunk(s), at line(s) {LINE_5}" in result.stderr
    work = ported.build(NEW) / "work"
    assert f"The rebase is stopped in {work}" in result.stderr
    assert (work / ".git" / "rebase-merge").is_dir()
    assert not ported.series_file(NEW).exists()

    # Not yet: the rebase is still in progress.
    early = ported.patchset("refresh", "1", "--base", NEW)
    assert early.returncode == 1
    assert "is in the middle of a rebase" in early.stderr

    text = (work / MOD).read_text()
    start, end = text.index("<<<<<<<"), text.index(">>>>>>>")
    end = text.index("\n", end) + 1
    (work / MOD).write_text(text[:start] + "x05 = 50  # upstream\n" + text[end:])
    git("add", MOD, cwd=work)
    git("rebase", "--continue", cwd=work, env={**ported.env, "GIT_EDITOR": "true"})
    assert subjects(work, "patchset-base") == [s for s, _ in port_series()]

    refreshed = ported.patchset("refresh", "1", "--base", NEW)
    assert refreshed.returncode == 0, refreshed.stderr
    names = ported.series_file(NEW).read_text().split()
    assert names == [
        "0001-Model-Change-the-fifth-line.patch",
        "0002-Model-Add-a-helper.patch",
    ]
    assert all((ported.patches(NEW) / n).is_file() for n in names)
    overlay = ported.overlay(NEW)
    assert "x05 = 50  # upstream\n" in (overlay / MOD).read_text()
    assert "x25 = 2500\n" in (overlay / MOD).read_text()
    assert (overlay / MOD_TEST).read_text() == (
        ported.overlay(OLD) / MOD_TEST
    ).read_text()
    assert (overlay / HELPER).is_file()
    checked = ported.patchset("check")
    assert checked.returncode == 0, checked.stderr
    assert "2 bases carry the same 2 patches" in checked.stdout


def test_rebase_refuses_a_base_that_has_a_series(
    ported: Project, tmp_path: Path
) -> None:
    new = release(tmp_path / "new")
    write_series(ported, new, port_series(), tmp_path / "series-new", NEW)
    before = ported.series_file(NEW).read_text()
    result = ported.patchset("rebase", "--onto", NEW)
    assert result.returncode == 1
    assert f"vLLM {NEW} already has a series" in result.stderr
    assert ported.series_file(NEW).read_text() == before
    assert not (ported.build(NEW) / "work").exists()


# bisect-run: which release's compiled extensions a checkout gets


@pytest.fixture
def declared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bases.toml declaring 0.34.0 (primary) and 0.33.0."""
    toml = tmp_path / "bases.toml"
    toml.write_text(
        '[[base]]\nversion = "0.34.0"\ncommit = "62d4bc3c7"\nprimary = true\n\n'
        '[[base]]\nversion = "0.33.0"\ncommit = "4ba787ec9"\n'
    )
    monkeypatch.setattr(bases, "DECLARATION", toml)


def test_release_of_falls_back_to_the_newest_tagged_ancestor(
    declared: None, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "vllm", {"README": "0.33.0\n"})
    git("init", "--quiet", cwd=src)
    git("add", "--all", cwd=src)
    git("commit", "--quiet", "-m", "0.33.0", cwd=src)
    git("tag", "v0.33.0", cwd=src)
    git("commit", "--quiet", "--allow-empty", "-m", "main after 0.33.0", cwd=src)
    release = gitutil.release_of(src)
    assert release is not None and release.version == "0.33.0"
    git("tag", "v0.34.0", cwd=src)
    git("commit", "--quiet", "--allow-empty", "-m", "main after 0.34.0", cwd=src)
    release = gitutil.release_of(src)
    assert release is not None and release.version == "0.34.0"
