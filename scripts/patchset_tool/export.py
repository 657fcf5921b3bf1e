# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`export`: one branch per patch, each with its written pull-request
description (`docs/pr/NNNN.md`, checked by `prdesc.check`).

A patch goes on the release when it applies there alone (`git am -3` in a
scratch clone) and nothing it or its tests use comes from an earlier patch,
else on the previous patch's branch. Commits carry only the exporter's
identity. All or nothing: every input is checked first, the work is done in
scratch, then the branches and the folder are published in one step that
signals do not interrupt (`gitutil.publishing`).
"""

import contextlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from . import gitutil, prdesc, trees
from .errors import PatchsetError
from .series import Patch, Series

KIND = "pr-descriptions"
SIGNOFF = re.compile(r"^\s*Signed-off-by:", re.I)
EMAIL = re.compile(r"<([^>]+)>")
TRAILER = re.compile(r"^[A-Za-z][\w-]*: ")


@dataclass
class Exported:
    patch: Patch
    branch: str
    commit: str
    description: Path
    base: str
    """`the release` or the branch it is stacked on."""
    reason: str


def check_branch_name(name: str, src: Path) -> None:
    """Raise unless `name` is a branch name git accepts as it is."""
    proc = gitutil.git("check-ref-format", "--branch", name, cwd=src, check=False)
    if (
        name.startswith("-")
        or name == "HEAD"
        or proc.returncode
        or proc.stdout.strip() != name
    ):
        raise PatchsetError(
            f"export: {name!r} is not a valid branch name (git check-ref-format "
            "--branch refuses it); nothing was created"
        )


def default_branches(series: Series) -> list[str]:
    """glm5next/<patch file name without .patch>, one per patch."""
    return [f"glm5next/{p.name.removesuffix('.patch')}" for p in series.patches]


def refuse_other_release(series: Series, src: Path) -> str:
    """Raise when `src` is a checkout of another vLLM release than the
    series' base (`gitutil.other_release`); return what was found."""
    want = series.base.version
    if why := gitutil.other_release(src, series.base):
        raise PatchsetError(
            f"export: {why}. Check out v{want} (or main after it), or export "
            "the series of that release with --base; nothing was created"
        )
    if found := gitutil.checkout_version(src):
        return f"{src} is vLLM {found[1]} ({found[2]})"
    return f"cannot tell which vLLM release {src} is (no vX.Y.Z tag); taken as {want}"


def project_identities(series: Series) -> set[str]:
    """The patches' own authors' e-mail addresses (the project's identity)."""
    return {m.group(1) for p in series.patches if (m := EMAIL.search(p.author))}


def exporter_identity(src: Path, series: Series) -> tuple[str, str]:
    """(name, email) of the person exporting, from git's configuration as
    seen in `src`; raise saying why when either is missing, or when it is
    the project's placeholder identity."""
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
    name, email = found
    if email in project_identities(series) or prdesc.PLACEHOLDER.search(
        f"{name} <{email}>"
    ):
        raise PatchsetError(
            f"export: your git identity {name} <{email}> is the project's "
            "placeholder; a commit is certified (DCO) under your own name: "
            "set user.name and user.email to yours"
        )
    return name, email


def own_message(text: str, name: str, email: str, drop: set[str]) -> str:
    """`text` without any Signed-off-by or line naming an identity in
    `drop`, signed off by `name <email>` alone."""
    lines = [
        line
        for line in text.rstrip().splitlines()
        if not SIGNOFF.match(line) and not any(d in line for d in drop)
    ]
    while lines and not lines[-1].strip():
        lines.pop()
    paragraph = []
    for line in reversed(lines):
        if not line.strip():
            break
        paragraph.append(line)
    trailer_block = paragraph and all(TRAILER.match(x) for x in paragraph)
    if not trailer_block:
        lines.append("")
    lines.append(f"Signed-off-by: {name} <{email}>")
    return "\n".join(lines) + "\n"


def _commit(scratch: Path, patch: Patch, name: str, email: str, drop: set[str]) -> str:
    """Apply `patch` at HEAD of `scratch` as one commit that `name <email>`
    authors, commits and signs off alone; its id."""
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
    }
    gitutil.am_series(scratch, [patch])
    text = gitutil.git("log", "-1", "--format=%B", cwd=scratch).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".msg", delete=False) as msg:
        msg.write(own_message(text, name, email, drop))
    try:
        gitutil.git(
            "commit",
            "--quiet",
            "--amend",
            "--reset-author",
            "--no-verify",
            "--cleanup=verbatim",
            "-F",
            msg.name,
            cwd=scratch,
            env=env,
        )
    finally:
        os.unlink(msg.name)
    shown = gitutil.git(
        "log", "-1", "--format=%an <%ae>%n%cn <%ce>%n%B", cwd=scratch
    ).stdout
    if any(d in shown for d in drop):
        raise PatchsetError(
            f"export: {patch.name}: the project's identity is still in the commit"
        )
    return gitutil.git("rev-parse", "HEAD", cwd=scratch).stdout.strip()


IMPORT = re.compile(r"^\s*(?:from|import)\s+([\w.]+)", re.M)


def _fixtures(text: str) -> set[str]:
    """Names of the pytest fixtures a conftest defines."""
    return set(re.findall(r"@pytest\.fixture[^\n]*\n(?:@[^\n]*\n)*\s*def (\w+)", text))


def needs_earlier(patch: Patch, earlier: list[Patch], tree: Path) -> str | None:
    """Why `patch` (applied alone at `tree`) needs the `earlier` patches:
    it imports a module they add, or its tests use a fixture only a
    conftest.py they add or change defines. None if neither."""
    added = {
        f.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for p in earlier
        for f in p.files
        if f.is_new and f.path.endswith(".py")
    }
    conftests = {
        f.path: p for p in earlier for f in p.files if f.path.endswith("conftest.py")
    }
    for diff in patch.files:
        path = tree / diff.path
        if diff.is_deleted or not diff.path.endswith(".py") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for module in IMPORT.findall(text):
            if module in added:
                owner = next(
                    p
                    for p in earlier
                    if any(f.path.startswith(module.replace(".", "/")) for f in p.files)
                )
                return f"{diff.path} imports {module}, which {owner.name[:4]} adds"
        if not Path(diff.path).name.startswith("test_"):
            continue
        used = set(re.findall(r"def test_\w+\(([^)]*)\)", text, re.S))
        params = {
            a.strip().split(":")[0].split("=")[0].strip()
            for group in used
            for a in group.split(",")
        }
        for conftest, owner in conftests.items():
            if not diff.path.startswith(str(Path(conftest).parent) + "/"):
                continue
            theirs = _fixtures(owner_text(owner, conftest, tree))
            present = tree / conftest
            here = _fixtures(present.read_text()) if present.is_file() else set()
            missing = sorted((params & theirs) - here)
            if missing:
                return (
                    f"its tests use the fixture(s) {', '.join(missing)} of "
                    f"{conftest}, which {owner.name[:4]} adds"
                )
    return None


def owner_text(patch: Patch, path: str, tree: Path) -> str:
    """The lines `patch` adds to `path` (enough to read its fixtures)."""
    out, inside = [], False
    for line in patch.path.read_text().split("\n"):
        if line.startswith("diff --git "):
            inside = line.endswith(f" b/{path}")
        elif inside and line.startswith("+") and not line.startswith("+++"):
            out.append(line[1:])
    return "\n".join(out)


@dataclass
class Plan:
    patch: Patch
    branch: str
    parent: int | None
    """Index of the patch whose branch it is stacked on; None: the release."""
    reason: str


def plan_and_commit(
    series: Series, src: Path, branches: list[str], who: tuple[str, str]
) -> tuple[list[Plan], list[str]]:
    """Decide each patch's base by trying, and make its commits in one
    scratch clone (no branch yet); the plans and each branch's head."""
    patches, drop = series.patches, project_identities(series)
    name, email = who
    plans: list[Plan] = []
    heads: list[str] = []
    with gitutil.scratch_clone(src) as scratch:
        release = gitutil.git("rev-parse", "HEAD", cwd=scratch).stdout.strip()
        for index, patch in enumerate(patches):
            parent: int | None = None
            reason = f"applies to vLLM {series.base.version} alone"
            gitutil.git("checkout", "--quiet", "--detach", release, cwd=scratch)
            if index:
                try:
                    gitutil.am_series(scratch, [patch])
                    why = needs_earlier(patch, patches[:index], scratch)
                except PatchsetError as exc:
                    first = str(exc).splitlines()[0]
                    why = f"it does not apply without them ({first})"
                earlier = ", ".join(p.name[:4] for p in patches[:index])
                if why:
                    parent, reason = index - 1, why
                else:
                    reason += f" and uses nothing {earlier} adds"
                start = heads[parent] if parent is not None else release
                gitutil.git("checkout", "--quiet", "--detach", start, cwd=scratch)
            heads.append(_commit(scratch, patch, name, email, drop))
            plans.append(Plan(patch, branches[index], parent, reason))
        gitutil.fetch_commits(src, scratch, heads)
    return plans, heads


def _staging(dest: Path, made: list[Path]) -> Path:
    """A scratch folder beside `dest`; the folders above it that had to be
    made are appended to `made` (removed again on failure)."""
    missing = [p for p in [dest.parent, *dest.parent.parents] if not p.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    made += missing
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.export-", dir=dest.parent))


def _put_in_place(staging: Path, dest: Path) -> None:
    """Replace `dest` (absent, empty, or the tool's) by `staging`."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        old.rmdir()
        dest.rename(old)
    try:
        staging.rename(dest)
    except OSError:
        if old is not None:
            old.rename(dest)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def description_name(branch: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", branch) + ".md"


def export(
    series: Series,
    src: Path,
    branches: list[str] | None,
    out_dir: Path,
    texts: list[str],
) -> tuple[list[Exported], str]:
    """Export `series` onto HEAD of `src` (see the module docstring), with
    `texts`, one description per patch; the branches made, and what was
    found of the checkout's release."""
    patches = series.patches
    if not patches:
        raise PatchsetError("export: the series is empty")
    names = branches or default_branches(series)
    if len(names) != len(patches):
        raise PatchsetError(
            f"export: {len(names)} --branch name(s) for {len(patches)} patches; "
            "give one per patch, in the series' order, or none"
        )
    if len(set(names)) != len(names):
        raise PatchsetError("export: the same --branch name is given twice")
    gitutil.require_clean_checkout(src)
    for name in names:
        check_branch_name(name, src)
        exists = gitutil.git(
            "rev-parse",
            "--verify",
            "--quiet",
            f"refs/heads/{name}",
            cwd=src,
            check=False,
        )
        if exists.returncode == 0:
            raise PatchsetError(
                f"export: {src}: branch {name} already exists; choose another "
                "--branch or delete it yourself (nothing was created)"
            )
    release = refuse_other_release(series, src)
    trees.claim_folder(out_dir, "--pr-dir", kind=KIND)
    who = exporter_identity(src, series)
    plans, heads = plan_and_commit(series, src, names, who)
    staging: Path | None = None
    exported: list[Exported] = []
    made: list[Path] = []
    try:
        staging = _staging(out_dir, made)
        trees.mark(staging, KIND)
        for plan, head, text in zip(plans, heads, texts, strict=True):
            base = names[plan.parent] if plan.parent is not None else "the release"
            path = staging / description_name(plan.branch)
            path.write_text(text, encoding="utf-8")
            exported.append(
                Exported(
                    plan.patch,
                    plan.branch,
                    head,
                    out_dir / path.name,
                    base,
                    plan.reason,
                )
            )
        refs = "".join(f"create refs/heads/{n} {h}\n" for n, h in zip(names, heads))
        with gitutil.publishing(f"branches {', '.join(names)} in {src}") as undo:
            # One transaction: every branch, or none (and so its undoing).
            gitutil.git("update-ref", "--stdin", cwd=src, input=refs)
            undo.append(
                partial(
                    gitutil.git,
                    "update-ref",
                    "--stdin",
                    cwd=src,
                    input=refs.replace("create ", "delete "),
                )  # fmt: skip
            )
            _put_in_place(staging, out_dir)
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        if not isinstance(exc, OSError):
            raise
        raise PatchsetError(
            f"export: {exc}; no branch and no description was left"
        ) from exc
    return exported, release
