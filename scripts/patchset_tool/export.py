# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`export`: a branch with one commit per patch, and the PR description."""

from pathlib import Path

from . import apply, gitutil, paths
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
        "The new tests fail on the base commit where the change is claimed "
        "and pass with the series; see each commit message.",
        "",
    ]
    return "\n".join(parts)


def export(src: Path, branch: str, description: Path) -> int:
    """Create `branch` at HEAD of `src` with the series on top, without
    touching the checkout's work tree; write the PR description."""
    patches = load_series(paths.PATCHES)
    if not patches:
        raise PatchsetError("export: the series is empty")
    gitutil.require_clean_checkout(src)
    exists = gitutil.git(
        "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", cwd=src, check=False
    )
    if exists.returncode == 0:
        raise PatchsetError(f"{src}: branch {branch} already exists")
    try:
        with apply.scratch_worktree(src, branch=branch) as scratch:
            gitutil.am_series(scratch, patches)
    except PatchsetError:
        gitutil.git("branch", "-D", branch, cwd=src, check=False)
        raise
    description.parent.mkdir(parents=True, exist_ok=True)
    description.write_text(pr_description(patches))
    return len(patches)
