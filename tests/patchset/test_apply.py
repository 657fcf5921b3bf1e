# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset apply` into build/: the good path and every kind of bad input."""

import hashlib
import os
import shutil
import signal
from pathlib import Path

import pytest
from projectkit import INIT, KDA, PROBE, Project, in_mount_namespace, needs_unshare


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            h.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return h.hexdigest()


def assert_nothing_written(project: Project) -> None:
    """Nothing under build/ but, at most, the base's build/<version>/ with
    the tree's lock file."""
    build = project.root / "build"
    lock = project.build() / ".vllm-patched.lock"
    leftovers = [p for p in build.rglob("*") if p not in (project.build(), lock)]
    assert leftovers == [], leftovers


def test_apply_materializes_the_patched_copy(
    project: Project, series: Path, pristine_site: Path
) -> None:
    before = tree_digest(pristine_site / "vllm" / "models")
    result = project.patchset("apply")
    assert result.returncode == 0, result.stderr
    assert "applied 2 patches, 4 files, " in result.stdout
    assert "2 base files match RECORD" in result.stdout
    patched = project.patched / "vllm"
    assert (project.patched / PROBE).read_text().endswith("ANSWER = 42\n")
    assert (
        (patched / "models/glm5next/__init__.py")
        .read_text()
        .endswith("# probe: patch 1\n# probe: patch 2\n")
    )
    extensions = list(patched.rglob("*.so"))
    assert extensions and all(so.is_symlink() for so in extensions)
    assert tree_digest(pristine_site / "vllm" / "models") == before
    assert not (pristine_site / PROBE).exists()


def test_second_apply_is_up_to_date(project: Project, series: Path) -> None:
    assert project.patchset("apply").returncode == 0
    stamp = project.patched / ".patchset-stamp.json"
    before = stamp.stat().st_mtime_ns
    again = project.patchset("apply")
    assert again.returncode == 0, again.stderr
    assert "already up to date" in again.stdout
    assert stamp.stat().st_mtime_ns == before


def test_check_mode_writes_nothing(project: Project, series: Path) -> None:
    result = project.patchset("apply", "--check")
    assert result.returncode == 0, result.stderr
    assert "--check: nothing written" in result.stdout
    assert_nothing_written(project)


def test_corrupt_patch_is_named(project: Project, series: Path) -> None:
    patch = sorted(project.patches().glob("0002-*.patch"))[0]
    lines = patch.read_text().splitlines(keepends=True)
    first_hunk = next(i for i, line in enumerate(lines) if line.startswith("@@"))
    del lines[first_hunk + 2]
    patch.write_text("".join(lines))
    result = project.patchset("apply")
    assert result.returncode == 1
    assert patch.name in result.stderr and "corrupt hunk" in result.stderr
    assert_nothing_written(project)


def test_drifted_base_file_is_named(
    project: Project, series: Path, pristine_site: Path
) -> None:
    kda = pristine_site / KDA
    original = kda.read_bytes()
    kda.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    try:
        result = project.patchset("apply")
    finally:
        kda.write_bytes(original)
    assert result.returncode == 1
    assert f"{KDA}: differs from the sha256 in RECORD" in result.stderr
    assert_nothing_written(project)


def test_half_applied_base_is_refused(
    project: Project, series: Path, pristine_site: Path
) -> None:
    """Patch 1 already applied in place to the install: its new file exists
    and __init__.py no longer matches RECORD."""
    init = pristine_site / INIT
    original = init.read_bytes()
    shutil.copyfile(project.overlay() / PROBE, pristine_site / PROBE)
    init.write_bytes(original + b"# probe: patch 1\n")
    try:
        result = project.patchset("apply")
    finally:
        init.write_bytes(original)
        (pristine_site / PROBE).unlink()
    assert result.returncode == 1
    assert f"creates {PROBE}, which already exists" in result.stderr
    assert_nothing_written(project)


def test_patch_creating_an_existing_file_is_refused(
    project: Project, series: Path, pristine_site: Path
) -> None:
    (pristine_site / PROBE).write_text("ANSWER = 0\n")
    try:
        result = project.patchset("apply")
    finally:
        (pristine_site / PROBE).unlink()
    assert result.returncode == 1
    assert "0001-" in result.stderr and f"creates {PROBE}" in result.stderr
    assert_nothing_written(project)


@pytest.mark.parametrize(
    "previous", [False, True], ids=["no-previous-tree", "previous-tree-kept"]
)
def test_interrupted_apply_leaves_no_partial_state(
    project: Project, series: Path, previous: bool
) -> None:
    if previous:
        assert project.patchset("apply").returncode == 0
        before = tree_digest(project.patched)
    env = {**project.env, "PATCHSET_TEST_KILL_AFTER": "1"}
    killed = project.patchset("apply", "--force", env=env)
    assert killed.returncode == -signal.SIGKILL
    if previous:
        assert tree_digest(project.patched) == before
    else:
        assert not project.patched.exists()
    again = project.patchset("apply")
    assert again.returncode == 0, again.stderr
    assert [p.name for p in (project.root / "build").iterdir()] == [project.version]
    assert sorted(p.name for p in project.build().iterdir()) == [
        ".vllm-patched.lock",
        "vllm-patched",
    ]


def test_wrong_vllm_version_is_refused(
    project: Project, series: Path, pristine_site: Path, tmp_path: Path
) -> None:
    site = tmp_path / "old-site"
    dist = next(pristine_site.glob("vllm-*.dist-info"))
    shutil.copytree(dist, site / "vllm-0.32.1.dist-info")
    metadata = site / "vllm-0.32.1.dist-info" / "METADATA"
    text = metadata.read_text()
    assert f"Version: {project.version}\n" in text
    metadata.write_text(
        text.replace(f"Version: {project.version}\n", "Version: 0.32.1\n")
    )
    result = project.patchset(
        "apply", env={**project.env, "GLM5NEXT_PATCHSET_SITE": str(site)}
    )
    assert result.returncode == 1
    assert "vllm 0.32.1 is installed" in result.stderr
    assert f"vllm=={project.version}" in result.stderr
    assert_nothing_written(project)


@needs_unshare
def test_read_only_destination_is_refused(
    project: Project, series: Path, tmp_path: Path
) -> None:
    """A read-only bind mount in a private mount namespace (root ignores
    permission bits, so chmod would prove nothing)."""
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    script = (
        f"mount --bind {readonly} {readonly} && "
        f"mount -o remount,bind,ro {readonly} && "
        f"exec python3 scripts/patchset apply --dest {readonly}/out"
    )
    result = in_mount_namespace(script, project.root, project.env)
    assert result.returncode == 1, result.stderr
    assert f"cannot write the patched tree to {readonly}/out" in result.stderr
    assert "Read-only file system" in result.stderr
    assert list(readonly.iterdir()) == []


def test_missing_git_is_reported(project: Project, series: Path) -> None:
    result = project.patchset("apply", env={**project.env, "PATH": "/nonexistent"})
    assert result.returncode == 1
    assert "git is not on PATH" in result.stderr
    assert_nothing_written(project)


def test_series_entry_without_file_is_named(project: Project, series: Path) -> None:
    with open(project.series_file(), "a") as handle:
        handle.write("0003-missing.patch\n")
    result = project.patchset("apply")
    assert result.returncode == 1
    assert "lists 0003-missing.patch" in result.stderr
    assert_nothing_written(project)


def test_overlay_that_disagrees_is_named(project: Project, series: Path) -> None:
    overlay = project.overlay() / KDA
    overlay.write_text(overlay.read_text() + "# edited by hand\n")
    result = project.patchset("apply")
    assert result.returncode == 1
    assert f"{KDA}: the series' result differs" in result.stderr
    assert_nothing_written(project)


def test_run_reaches_either_tree(
    project: Project, series: Path, pristine_site: Path
) -> None:
    # Where `import vllm` would load it from, without importing it (seconds).
    where = "import os, importlib.util as u; print(u.find_spec('vllm').origin, "
    where += "os.environ['VLLM_TARGET_DEVICE'])"
    patched = project.patchset("run", "--", "python", "-c", where)
    assert patched.returncode == 0, patched.stderr
    assert patched.stdout.splitlines()[-1].split() == [
        str(project.patched / "vllm" / "__init__.py"),
        "cpu",
    ]
    base = project.patchset("run", "--pristine", "--", "python", "-c", where)
    assert base.returncode == 0, base.stderr
    assert "site-packages/vllm/__init__.py cpu" in base.stdout


def test_env_without_environment_says_so(project: Project, tmp_path: Path) -> None:
    env = {**project.env, "GLM5NEXT_PATCHSET_CACHE": str(tmp_path / "empty")}
    result = project.patchset("env", env=env)
    assert result.returncode == 1
    assert "no managed environment" in result.stderr
    assert "scripts/patchset setup" in result.stderr


def test_env_prints_the_managed_python(project: Project) -> None:
    result = project.patchset("env")
    assert result.returncode == 0
    assert os.access(result.stdout.strip(), os.X_OK)
