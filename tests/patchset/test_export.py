# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`export`: one branch per patch from a scratch vLLM checkout, signed off by
the exporter alone, each with its written description (docs/pr/NNNN.md);
`export --check`; and each way an export could harm (issue 27's cases)."""

import os
from pathlib import Path

import pytest
from projectkit import (
    KDA,
    PROBE,
    PROBE_TEST,
    SPDX,
    Project,
    git,
    write_series,
)

EXPORTER = "Ex Porter <ex@porter.dev>"
FIRST = "glm5next/0001-Model-Add-a-probe-module-to-glm5next"
SECOND = "glm5next/0002-Model-Touch-KDA-and-the-package-init"


def exporter_env(project: Project, home: Path) -> dict[str, str]:
    """The project's environment with the exporter's git identity alone
    (the test helper's GIT_AUTHOR_* are not inherited)."""
    home.mkdir(exist_ok=True)
    (home / ".gitconfig").write_text(
        "[user]\n\tname = Ex Porter\n\temail = ex@porter.dev\n"
    )
    env = {**project.env, "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"}
    for name in ("XDG_CONFIG_HOME", "GIT_CONFIG_GLOBAL", "EMAIL"):
        env.pop(name, None)
    for who in ("AUTHOR", "COMMITTER"):
        env.pop(f"GIT_{who}_NAME", None)
        env.pop(f"GIT_{who}_EMAIL", None)
    return env


def make_checkout(series: Path, tmp_path: Path) -> Path:
    """A clone of the repository the patches came from, at their base."""
    clone = tmp_path / "checkout"
    git("clone", "--quiet", str(series), str(clone), cwd=tmp_path)
    git("reset", "--quiet", "--hard", "base", cwd=clone)
    git("tag", "release", cwd=clone)
    return clone


GOOD = f"""## Overview

The probe answers in 0.42x the time and holds 1,234,567 tokens (see #12345).

## Claims

- `{PROBE}` is new, tested by `{PROBE_TEST}`.

## Validation

`pytest -v -s {PROBE_TEST}` on the release and on this branch:

```text
1 passed
```

## Details

None.

<details>
<summary> Pull Request Checklist </summary>

- [x] AI assistance was used during the creation of this PR.
</details>
"""


@pytest.fixture(autouse=True)
def written(project: Project) -> str:
    """Each patch's written description, the measurements its figures come
    from and the pristine and patched logs of its test."""
    (project.root / "docs" / "pr").mkdir(parents=True)
    for number in ("0001", "0002"):
        (project.root / "docs" / "pr" / f"{number}.md").write_text(GOOD)
    (project.root / "docs" / "measurements.md").write_text(
        "| tree | time vs pristine | tokens |\n| --- | --- | --- |\n"
        "| patched | 0.42 | 1,234,567 |\n"
    )
    return GOOD


def with_logs(project: Project) -> None:
    logs = project.root / "build" / "test-logs"
    logs.mkdir(parents=True)
    (logs / "model-tests.log").write_text(f"{PROBE_TEST}::test_probe PASSED\n")


@pytest.fixture
def checkout(series: Path, tmp_path: Path) -> Path:
    return make_checkout(series, tmp_path)


@pytest.fixture
def env(project: Project, tmp_path: Path) -> dict[str, str]:
    return exporter_env(project, tmp_path / "home")


def export(project: Project, env: dict[str, str], *args: str):
    return project.patchset("export", *args, env=env)


def branches(repo: Path) -> list[str]:
    return git("branch", "--format=%(refname:short)", cwd=repo).split()


def state(repo: Path) -> tuple[str, str, list[str]]:
    return (
        git("rev-parse", "HEAD", cwd=repo),
        git("status", "--porcelain", cwd=repo),
        branches(repo),
    )


def test_two_branches_signed_off_by_the_exporter_alone(
    project: Project, checkout: Path, env: dict[str, str], tmp_path: Path
) -> None:
    before = state(checkout)
    out = tmp_path / "pr"
    result = export(project, env, "--vllm-src", str(checkout), "--pr-dir", str(out))
    assert result.returncode == 0, result.stderr
    assert git("rev-parse", "HEAD", cwd=checkout) == before[0]
    assert git("status", "--porcelain", cwd=checkout) == before[1]
    assert set(branches(checkout)) - set(before[2]) == {FIRST, SECOND}
    # 0001 on the release; 0002 touches what 0001 changed: stacked on it.
    assert git("rev-parse", f"{FIRST}~1", cwd=checkout) == before[0]
    assert git("rev-parse", f"{SECOND}~1", cwd=checkout) == git(
        "rev-parse", FIRST, cwd=checkout
    )
    assert f"on {FIRST} (it does not apply without them" in result.stdout
    log = git(
        "log", "--format=%an <%ae>|%cn <%ce>%n%B", f"release..{SECOND}", cwd=checkout
    )
    assert "a@example.com" not in log and "Test Author" not in log
    for commit in git("rev-list", f"release..{SECOND}", cwd=checkout).split():
        who = git("log", "-1", "--format=%an <%ae>|%cn <%ce>", commit, cwd=checkout)
        assert who.strip() == f"{EXPORTER}|{EXPORTER}"
        body = git("log", "-1", "--format=%B", commit, cwd=checkout)
        trailers = [x for x in body.splitlines() if x.startswith("Signed-off-by:")]
        assert trailers == [f"Signed-off-by: {EXPORTER}"]
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        ".patchset-owned",
        "glm5next_0001-Model-Add-a-probe-module-to-glm5next.md",
        "glm5next_0002-Model-Touch-KDA-and-the-package-init.md",
    ]
    assert (out / files[1]).read_text() == GOOD


def independent_patches():
    """Patch 2 touches only kda.py and adds a test that needs nothing of
    patch 1; with `use_fixture`, its test takes patch 1's conftest fixture."""

    def patches(use_fixture: bool):
        conftest = "tests/models/glm5next/conftest.py"
        argument = "probe_answer" if use_fixture else ""
        return [
            (
                "[Model] Add a probe module to glm5next",
                {
                    PROBE: lambda _: SPDX + "ANSWER = 42\n",
                    PROBE_TEST: lambda _: SPDX + "def test_probe():\n    pass\n",
                    conftest: lambda _: (
                        SPDX + "import pytest\n\n\n@pytest.fixture\n"
                        "def probe_answer():\n    return 42\n"
                    ),
                },
            ),
            (
                "[Model] Touch KDA",
                {
                    KDA: lambda old: old.replace("import ", "import  ", 1),
                    "tests/models/glm5next/test_kda_touch.py": lambda _: (
                        SPDX + f"def test_touch({argument}):\n    pass\n"
                    ),
                },
            ),
        ]

    return patches


@pytest.mark.parametrize("use_fixture", [False, True], ids=["alone", "fixture"])
def test_a_patch_goes_on_the_release_when_it_works_alone(
    project: Project,
    pristine_site: Path,
    tmp_path: Path,
    env: dict[str, str],
    use_fixture: bool,
) -> None:
    repo = write_series(
        project, pristine_site, independent_patches()(use_fixture), tmp_path
    )
    checkout = make_checkout(repo, tmp_path)
    result = export(project, env, "--vllm-src", str(checkout))
    assert result.returncode == 0, result.stderr
    second = "glm5next/0002-Model-Touch-KDA"
    parent = git("rev-parse", f"{second}~1", cwd=checkout)
    if use_fixture:
        assert parent == git("rev-parse", FIRST, cwd=checkout)
        assert "fixture(s) probe_answer of tests/models/glm5next/conftest.py" in (
            result.stdout
        )
    else:
        assert parent == git("rev-parse", "release", cwd=checkout)
        assert "alone and uses nothing 0001 adds" in result.stdout
    description = project.root / "build" / "pr-descriptions"
    assert (description / ".patchset-owned").is_file()


def check(project: Project, env: dict[str, str], text: str, checkout: Path):
    path = project.root / "candidate.md"
    path.write_text(text)
    return export(project, env, "--check", str(path), "--vllm-src", str(checkout))


RAN = f"\n```text\n{PROBE_TEST}::test_probe PASSED\n```\n"


def test_check_passes_a_good_description(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    with_logs(project)
    result = check(project, env, GOOD + RAN, checkout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout


def test_check_takes_a_test_the_gpu_results_show(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    """A test id from the junit XML `gpu --collect` brought back counts as run."""
    results = project.root / "build" / "gpu" / f"results-{project.version}"
    results.mkdir(parents=True)
    module = PROBE_TEST.removesuffix(".py").replace("/", ".")
    (results / "junit-patched.xml").write_text(
        f'<testsuite><testcase classname="{module}" name="test_probe"/></testsuite>'
    )
    result = check(project, env, GOOD + RAN, checkout)
    assert result.returncode == 0, result.stdout + result.stderr


FAILED = 'name="test_probe"><failure/></testcase>'


@pytest.mark.parametrize(
    "log, problem",
    [
        (
            f"{PROBE_TEST}::test_probe SKIPPED (needs a GPU)\n",
            "the recorded logs give SKIPPED",
        ),
        (f"ERROR collecting {PROBE_TEST}::test_probe\n", "no recorded log shows it"),
        (
            f'<testcase classname="{PROBE_TEST[:-3].replace("/", ".")}" {FAILED}',
            "the recorded logs give FAILED",
        ),
    ],
    ids=["skipped", "named-not-run", "junit-failed"],
)
def test_check_takes_a_test_as_run_only_with_the_outcome_its_log_gives(
    project: Project, checkout: Path, env: dict[str, str], log: str, problem: str
) -> None:
    logs = project.root / "build" / "test-logs"
    logs.mkdir(parents=True)
    (logs / "model-tests.log").write_text(log)
    result = check(project, env, GOOD + RAN, checkout)
    assert result.returncode == 1, result.stdout + result.stderr
    assert problem in result.stdout


LONG = "word " * 701


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda t: t.replace("## Claims\n", ""), "heading '## Claims'"),
        (
            lambda t: t.replace("Pull Request Checklist", "Some"),
            "heading 'Pull Request Checklist",
        ),
        (lambda t: t + "\nIt is 7.77x faster.\n", "the figure 7.77 is not in"),
        (lambda t: t + "\nRun `scripts/patchset test`.\n", "names scripts/patchset,"),
        (lambda t: t + "\nLogs: build/test-logs/.\n", "names build/test-logs/,"),
        (lambda t: t + "\nSee docs/measurements.md.\n", "names docs/measurements.md"),
        (lambda t: t + RAN, "test_probe ran; no recorded log shows it"),
        (lambda t: t + LONG, "words outside collapsed <details> (at most 700)"),
        (
            lambda t: t + f"<details>{LONG * 2}</details>",
            "words in all (at most 1200)",
        ),
        (lambda t: t + "\nSeed 2b9dbddb maintainers\n", "a placeholder identity"),
    ],
    ids=[
        "heading",
        "checklist",
        "figure",
        "tool-path",
        "log-folder",
        "measurements-path",
        "test-not-run",
        "too-long-open",
        "too-long-in-all",
        "identity",
    ],
)
def test_check_names_what_is_wrong(
    project: Project, checkout: Path, env: dict[str, str], damage, problem: str
) -> None:
    result = check(project, env, damage(GOOD), checkout)
    assert result.returncode == 1
    assert problem in result.stdout
    assert "Traceback" not in result.stderr


def test_a_missing_description_is_one_line_and_nothing_made(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    (project.root / "docs" / "pr" / "0002.md").unlink()
    before = state(checkout)
    result = export(project, env, "--vllm-src", str(checkout))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        (
            f"patchset: error: export: {project.root}/docs/pr/0002.md is missing: "
            "write 0002-Model-Touch-KDA-and-the-package-init.patch's description "
            "there first; nothing was created"
        )
    ]
    assert_nothing_made(checkout, before, project)


def test_a_description_failing_the_check_is_not_exported(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    (project.root / "docs" / "pr" / "0001.md").write_text(GOOD + "It is 7.77x.\n")
    before = state(checkout)
    result = export(project, env, "--vllm-src", str(checkout))
    assert result.returncode == 1
    assert "0001.md: the figure 7.77 is not in docs/measurements.md" in result.stderr
    assert_nothing_made(checkout, before, project)


@pytest.mark.parametrize("kind", ["huge", "endless"])
def test_check_of_a_huge_or_endless_file_is_one_line(
    project: Project, env: dict[str, str], tmp_path: Path, kind: str
) -> None:
    target = tmp_path / "description.md"
    if kind == "huge":
        with open(target, "wb") as handle:
            handle.truncate(2 << 20)
    else:
        os.mkfifo(target)  # no writer: a read would wait forever
    result = export(project, env, "--check", str(target))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "cannot read it" in result.stderr


# ---------------------------------------------------- harms (issue 27)


def assert_nothing_made(checkout: Path, before, project: Project) -> None:
    assert state(checkout) == before
    assert not (project.root / "build" / "pr-descriptions").exists()


def test_pr_dir_onto_a_file_it_did_not_make_is_refused(
    project: Project, checkout: Path, env: dict[str, str], tmp_path: Path
) -> None:
    mine = tmp_path / "notes.md"
    mine.write_text("my notes\n")
    folder = tmp_path / "drafts"
    folder.mkdir()
    (folder / "draft.md").write_text("my draft\n")
    before = state(checkout)
    for target in (mine, folder):
        result = export(
            project, env, "--vllm-src", str(checkout), "--pr-dir", str(target)
        )
        assert result.returncode == 1
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "nothing was changed" in result.stderr
    assert mine.read_text() == "my notes\n"
    assert sorted(p.name for p in folder.iterdir()) == ["draft.md"]
    assert state(checkout) == before


def test_a_failure_after_the_first_branch_leaves_no_branch(
    project: Project, checkout: Path, env: dict[str, str], tmp_path: Path
) -> None:
    """`x` is created, then `x/y` cannot be (a ref cannot be both a branch
    and a folder of branches): `x` must go again, and no description stays."""
    before = state(checkout)
    out = tmp_path / "pr"
    result = export(
        project,
        env,
        "--vllm-src",
        str(checkout),
        "--branch",
        "x",
        "--branch",
        "x/y",
        "--pr-dir",
        str(out),
    )
    assert result.returncode == 1
    assert "could not put branches x, x/y" in result.stderr and "x/y" in result.stderr
    assert "Traceback" not in result.stderr
    assert state(checkout) == before
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".pr")] == []


def test_a_description_that_cannot_be_written_leaves_no_branch(
    project: Project, checkout: Path, env: dict[str, str], tmp_path: Path
) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a folder would go\n")
    before = state(checkout)
    result = export(
        project, env, "--vllm-src", str(checkout), "--pr-dir", str(blocked / "pr")
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert state(checkout) == before
    assert blocked.read_text() == "a file where a folder would go\n"


@pytest.mark.parametrize("name", ["-D", "a..b", "x y", "HEAD", "@{-1}", "x.lock"])
def test_a_branch_name_git_refuses_is_refused_first(
    project: Project, checkout: Path, env: dict[str, str], name: str
) -> None:
    before = state(checkout)
    result = export(
        project,
        env,
        "--vllm-src",
        str(checkout),
        f"--branch={name}",
        "--branch",
        "ok",
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"patchset: error: export: {name!r} is not a valid branch name (git "
        "check-ref-format --branch refuses it); nothing was created"
    )
    assert_nothing_made(checkout, before, project)


def test_an_existing_branch_is_refused(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    git("branch", SECOND, cwd=checkout)
    before = state(checkout)
    result = export(project, env, "--vllm-src", str(checkout))
    assert result.returncode == 1
    assert f"branch {SECOND} already exists" in result.stderr
    assert_nothing_made(checkout, before, project)


def test_a_build_folder_linked_into_site_packages_is_refused(
    project: Project, checkout: Path, env: dict[str, str], tmp_path: Path
) -> None:
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "pkg").mkdir(parents=True)
    (project.root / "build").symlink_to(site / "pkg")
    before = state(checkout)
    result = export(project, env, "--vllm-src", str(checkout))
    assert result.returncode == 1
    assert "a Python installation" in result.stderr
    assert list((site / "pkg").iterdir()) == []
    assert state(checkout) == before


def test_a_checkout_of_another_release_is_refused_and_named(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    git("tag", "v0.1.0", cwd=checkout)
    before = state(checkout)
    result = export(project, env, "--vllm-src", str(checkout))
    assert result.returncode == 1
    assert "is vLLM 0.1.0 (git describe: v0.1.0)" in result.stderr
    assert f"checkout of vLLM {project.version}, the release" in result.stderr
    assert_nothing_made(checkout, before, project)


def test_the_release_tag_of_the_base_is_accepted(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    git("tag", f"v{project.version}", cwd=checkout)
    result = export(project, env, "--vllm-src", str(checkout))
    assert result.returncode == 0, result.stderr
    assert f"is vLLM {project.version} (git describe: v{project.version})" in (
        result.stdout
    )


def test_the_placeholder_identity_is_refused(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    git("config", "user.email", "maintainers@users.noreply.seed.example", cwd=checkout)
    before = state(checkout)
    result = export(project, env, "--vllm-src", str(checkout))
    assert result.returncode == 1
    assert "placeholder" in result.stderr
    assert_nothing_made(checkout, before, project)


def test_no_git_identity_is_refused(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    os.unlink(Path(env["HOME"]) / ".gitconfig")
    before = state(checkout)
    result = export(project, env, "--vllm-src", str(checkout))
    assert result.returncode == 1
    assert "git has no user.name configured" in result.stderr
    assert "Signed-off-by" in result.stderr
    assert_nothing_made(checkout, before, project)


def test_a_second_export_replaces_only_its_own_descriptions(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    assert export(project, env, "--vllm-src", str(checkout)).returncode == 0
    again = export(
        project, env, "--vllm-src", str(checkout), "--branch", "a", "--branch", "b"
    )
    assert again.returncode == 0, again.stderr
    out = project.root / "build" / "pr-descriptions"
    assert sorted(p.name for p in out.iterdir()) == [".patchset-owned", "a.md", "b.md"]
    assert git("rev-parse", "b~1", cwd=checkout) == git("rev-parse", "a", cwd=checkout)


def test_wrong_number_of_branch_names_is_one_line(
    project: Project, checkout: Path, env: dict[str, str]
) -> None:
    before = state(checkout)
    result = export(project, env, "--vllm-src", str(checkout), "--branch", "only")
    assert result.returncode == 1
    assert "1 --branch name(s) for 2 patches" in result.stderr
    assert_nothing_made(checkout, before, project)
