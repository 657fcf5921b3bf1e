# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`export`: a branch with one commit per patch, and the PR description."""

from pathlib import Path

from . import apply, gitutil
from .bases import Base
from .errors import PatchsetError
from .series import Patch, load_series


def pr_description(patches: list[Patch]) -> str:
    """The pull-request description: each patch's subject and message."""
    title = (
        patches[0].subject
        if len(patches) == 1
        else (
            "[Model] GLM-5.3-Flash: online quantization of BF16 attention "
            "projections and opt-in FP8 MLA KV cache on Hopper"
        )
    )
    parts = [f"# {title}", "", "## Purpose", ""]
    for patch in patches:
        body = "\n".join(
            line
            for line in patch.body.splitlines()
            if not line.startswith("Signed-off-by:")
        ).strip()
        parts += [f"### {patch.subject}", "", body, ""]
    parts += [
        "## Test Plan",
        "",
        "```",
        "pytest -v -s tests/models/glm5next",
        "```",
        "",
        "Selected in CI by the `glm5next-unit-tests` step.",
        "",
        "## Test Result",
        "",
        (
            "The new tests fail on the base commit where the change is claimed "
            "and pass with the series; see each commit message."
        ),
        "",
    ]
    return "\n".join(parts)


def exporter_identity(src: Path) -> tuple[str, str]:
    """(name, email) of the person exporting, from git's configuration as
    seen in `src`; raise saying why when either is missing."""
    found = []
    for key in ("user.name", "user.email"):
        value = gitutil.git("config", "--get", key, cwd=src, check=False).stdout
        if not value.strip():
            raise PatchsetError(
                f"export: git has no {key} configured in {src}; the pull "
                "request's commits carry your authorship and your "
                "Signed-off-by (DCO). Set it with `git config --global "
                f"{key} ...` and run export again"
            )
        found.append(value.strip())
    return found[0], found[1]


def _own_the_commits(scratch: Path, base_head: str, name: str, email: str) -> None:
    """Make the exporter the author of every commit after `base_head` and
    add their Signed-off-by (the project's own stays in the trailers)."""
    env = gitutil.outside_repo_env(scratch)
    env.update(
        GIT_AUTHOR_NAME=name,
        GIT_AUTHOR_EMAIL=email,
        GIT_COMMITTER_NAME=name,
        GIT_COMMITTER_EMAIL=email,
    )
    proc = gitutil.git(
        "rebase",
        "--quiet",
        "--exec",
        "git commit --quiet --amend --no-edit --reset-author --signoff",
        base_head,
        cwd=scratch,
        env=env,
        check=False,
    )
    if proc.returncode:
        raise PatchsetError(f"export: could not re-author the commits:\n{proc.stderr}")


def export(base: Base, src: Path, branch: str, description: Path) -> int:
    """Create `branch` at HEAD of `src` with `base`'s series on top, one
    commit per patch authored and signed off by the person exporting,
    without touching the checkout's work tree; write the PR description."""
    patches = load_series(base.patches)
    if not patches:
        raise PatchsetError("export: the series is empty")
    head = gitutil.require_clean_checkout(src)
    name, email = exporter_identity(src)
    exists = gitutil.git(
        "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", cwd=src, check=False
    )
    if exists.returncode == 0:
        raise PatchsetError(f"{src}: branch {branch} already exists")
    try:
        with apply.scratch_worktree(src, branch=branch) as scratch:
            gitutil.am_series(scratch, patches)
            _own_the_commits(scratch, head, name, email)
    except PatchsetError:
        gitutil.git("branch", "-D", branch, cwd=src, check=False)
        raise
    description.parent.mkdir(parents=True, exist_ok=True)
    description.write_text(pr_description(patches))
    return len(patches)
