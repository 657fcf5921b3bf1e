# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`export`: a branch with one commit per patch, and the PR description."""

import re
from pathlib import Path

from . import gitutil
from .errors import PatchsetError
from .series import Patch, Series

TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
FALLBACK_TEMPLATE = "## Purpose\n\n## Test Plan\n\n## Test Result\n"
BLOCK_START = re.compile(r"^(\s*[-*+] |\s*\d+[.)] |#|>|\||    |\t|<)")
TEST_COMMAND = "pytest -v -s tests/models/glm5next"


def unwrap(text: str) -> str:
    """Join the hard-wrapped lines of each paragraph and list item (GitHub
    renders a newline in a PR body as a line break); code blocks, headings,
    tables and new list items stay as they are."""
    out: list[str] = []
    in_code = joinable = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            out.append(line)
            joinable = False
        elif in_code or not line.strip():
            out.append(line)
            joinable = False
        elif joinable and not BLOCK_START.match(line):
            out[-1] = f"{out[-1].rstrip()} {line.strip()}"
        else:
            out.append(line)
            joinable = not line.startswith(("#", "|", "    ", "\t", "<"))
    return "\n".join(out)


def _section_text(heading: str, patches: list[Patch], details_elsewhere: bool) -> str:
    """What the series says under one of the template's headings ("" for a
    heading it has nothing for)."""
    name = heading.lower()
    if any(k in name for k in ("overview", "purpose", "summary")):
        lines = [
            f"This series makes {len(patches)} change(s) to vLLM, one commit each:",
            "",
            *(f"- {p.subject}" for p in patches),
        ]
        if not details_elsewhere:
            lines += ["", _details(patches)]
        return "\n".join(lines)
    if "claim" in name:
        return "\n".join(f"- {p.subject}" for p in patches)
    if "validation" in name or "test plan" in name:
        return (
            f"```\n{TEST_COMMAND}\n```\n\nSelected in CI by the "
            "`glm5next-unit-tests` step. The new tests fail on the base "
            "commit where each change is claimed and pass with the series; "
            "each commit message gives its figures."
        )
    if "test result" in name:
        return (
            "The new tests fail on the base commit where the change is "
            "claimed and pass with the series; see each commit message."
        )
    if "detail" in name:
        return _details(patches)
    return ""


def _details(patches: list[Patch]) -> str:
    parts = []
    for patch in patches:
        body = "\n".join(
            line
            for line in patch.body.splitlines()
            if not line.startswith("Signed-off-by:")
        ).strip()
        parts += [f"### {patch.subject}", "", unwrap(body), ""]
    return "\n".join(parts).rstrip()


def pr_description(patches: list[Patch], template: str | None = None) -> str:
    """The pull-request description in the layout of `template` (the vLLM
    release's own .github/PULL_REQUEST_TEMPLATE.md): under each of its
    headings what the series says, in place of the template's comment;
    everything else (the checklist) as the template has it."""
    title = (
        patches[0].subject
        if len(patches) == 1
        else (
            "[Model] GLM-5.3-Flash: online quantization of BF16 attention "
            "projections and opt-in FP8 MLA KV cache on Hopper"
        )
    )
    text = template or FALLBACK_TEMPLATE
    lines = text.splitlines()
    headings = [line for line in lines if line.startswith("## ")]
    details_elsewhere = any("detail" in h.lower() for h in headings)
    out = [f"<!-- title: {title} -->", ""]
    index = 0
    while index < len(lines):
        line = lines[index]
        out.append(line)
        index += 1
        if not line.startswith("## "):
            continue
        filled = _section_text(line[3:], patches, details_elsewhere)
        if not filled:
            continue
        # The heading's own guidance (an HTML comment) gives way to the text.
        while index < len(lines) and not lines[index].strip():
            index += 1
        if index < len(lines) and lines[index].lstrip().startswith("<!--"):
            while index < len(lines) and "-->" not in lines[index]:
                index += 1
            index += 1
        out += ["", filled]
        if index < len(lines) and lines[index].strip():
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def release_template(src: Path) -> str | None:
    """The PR template of the vLLM checkout `src` at HEAD, if it has one."""
    shown = gitutil.git("show", f"HEAD:{TEMPLATE}", cwd=src, check=False)
    return shown.stdout if shown.returncode == 0 else None


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


def export(series: Series, src: Path, branch: str, description: Path) -> int:
    """Create `branch` at HEAD of `src` with `series` on top, one commit
    per patch authored and signed off by the person exporting, without
    touching the checkout's work tree; write the PR description."""
    patches = series.patches
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
        with gitutil.scratch_worktree(src, branch=branch) as scratch:
            gitutil.am_series(scratch, patches)
            _own_the_commits(scratch, head, name, email)
    except PatchsetError:
        gitutil.git("branch", "-D", branch, cwd=src, check=False)
        raise
    description.parent.mkdir(parents=True, exist_ok=True)
    description.write_text(pr_description(patches, release_template(src)))
    return len(patches)
