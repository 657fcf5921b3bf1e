# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Lint the overlays, the tests and the tool the way vLLM lints.

`ruff check`, `ruff format --diff`, mypy (each overlay inside its base's patched
tree, grouped as that base's tools/pre_commit/mypy.py groups it) and typos, each
run with the given Python's own tools; settings come from pyproject.toml.

Usage: python -m patchset_tool.lint [--python PY] [--only CHECK ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from . import paths, upstream
from .bases import Base, load_bases

LINT_DIRS = ("vllm_overlay", "tests", "scripts")
PYTHON_VERSION = "3.11"
CHECKS = ("ruff check", "ruff format", "mypy", "typos")
UPSTREAM_MYPY = "tools/pre_commit/mypy.py"

Result = tuple[str, bool, str]


def _run(
    command: list[str], cwd: Path, env: dict[str, str] | None = None
) -> tuple[bool, str]:
    """Run a command; (exit status 0, its output with the command line)."""
    shown = "$ " + " ".join(command)
    try:
        done = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, check=False
        )
    except OSError as exc:
        return False, f"{shown}\ncannot run: {exc}"
    output = (done.stdout + done.stderr).strip()
    return done.returncode == 0, f"{shown}\n{output}".strip()


def _python_scripts(directory: Path) -> list[Path]:
    """Extension-less Python scripts (a python shebang) in a directory."""
    found = []
    for path in sorted(directory.glob("*")):
        if path.is_file() and not path.suffix:
            with path.open("rb") as handle:
                first = handle.readline()
            if first.startswith(b"#!") and b"python" in first:
                found.append(path)
    return found


def _targets(repo: Path) -> list[str]:
    targets = [name for name in LINT_DIRS if (repo / name).is_dir()]
    if (repo / "scripts").is_dir():
        targets += [
            p.relative_to(repo).as_posix() for p in _python_scripts(repo / "scripts")
        ]
    return targets


def _python_files(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _typos(repo: Path, python: str, targets: list[str]) -> Result:
    binary = Path(python).parent / "typos"
    if not binary.is_file():
        found = shutil.which("typos")
        if found is None:
            return (
                "typos",
                False,
                (
                    f"no typos binary next to {python} or "
                    "on PATH; install the pinned `typos` package"
                ),
            )
        binary = Path(found)
    ok, output = _run([str(binary), "--force-exclude", *targets], repo)
    return "typos", ok, output


def upstream_mypy_groups(base: Base, files: list[str]) -> dict[str, list[str]]:
    """`files` (paths in vLLM's tree) grouped by `group_files()` of the base's
    own tools/pre_commit/mypy.py, empty groups left out: "" is checked at the
    configured follow_imports, any other group with `--follow-imports skip`."""
    source = upstream.release_files(base.version, [UPSTREAM_MYPY])[UPSTREAM_MYPY]
    namespace: dict[str, object] = {"__name__": "upstream_mypy"}
    exec(compile(source, UPSTREAM_MYPY, "exec"), namespace)
    group_files = namespace["group_files"]
    assert callable(group_files)
    groups: dict[str, list[str]] = group_files(files)
    return {group: members for group, members in groups.items() if members}


def _mypy(repo: Path, python: str, bases: list[Base], require_tree: bool) -> Result:
    def command(group: str) -> list[str]:
        """The mypy command with the group's own cache: groups sharing one would
        overwrite each other's entries (each base's tree has its own `vllm`,
        and the options differ), leaving every run cold. The caches live
        beside the environments, not in the clone: mypy takes an entry
        whose file's hash matches, so a fresh clone starts warm."""
        cache = paths.cache_root() / "mypy-cache" / group
        return [
            python,
            "-m",
            "mypy",
            "--python-version",
            PYTHON_VERSION,
            "--config-file",
            str(repo / "pyproject.toml"),
            "--cache-dir",
            str(cache),
        ]

    outputs: list[str] = []
    ok = True

    for base in bases:
        overlay, tree = base.overlay, base.patched_tree()
        files = [p.relative_to(overlay).as_posix() for p in _python_files(overlay)]
        missing = [f for f in files if not (tree / f).is_file()]
        if not files:
            continue
        if not tree.is_dir() and not require_tree:
            outputs.append(f"skipped {overlay}: no patched tree at {tree}")
        elif missing:
            ok = False
            outputs.append(
                f"patched tree {tree} lacks {', '.join(missing)}; "
                "apply the series first (scripts/patchset apply --base ...)"
            )
        else:
            # Upstream's hook runs mypy in pre-commit's own environment,
            # without vLLM's dependencies; not searching site-packages does
            # the same (and avoids broken stubs there, such as opencv's).
            for group, members in upstream_mypy_groups(base, files).items():
                extra = ["--follow-imports", "skip"] if group else []
                cache = f"{overlay.name}-{group.replace('/', '-') or 'default'}"
                good, text = _run(
                    [*command(cache), "--no-site-packages", *extra, *members], tree
                )
                ok &= good
                outputs.append(text)

    scripts = repo / "scripts"
    if scripts.is_dir():
        env = {**os.environ, "MYPYPATH": str(scripts)}
        targets = [
            p.relative_to(repo).as_posix()
            for p in [
                *_python_scripts(scripts),
                *[
                    d
                    for d in sorted(scripts.iterdir())
                    if (d / "__init__.py").is_file()
                ],
            ]
        ]
        if targets:
            good, text = _run(
                [*command("scripts"), "--explicit-package-bases", *targets], repo, env
            )
            ok &= good
            outputs.append(text)

    if _python_files(repo / "tests"):
        good, text = _run(
            [*command("tests"), "--explicit-package-bases", "tests"],
            repo,
            {**os.environ, "MYPYPATH": str(scripts)},
        )
        ok &= good
        outputs.append(text)
    return "mypy", ok, "\n\n".join(outputs)


def run_lint(
    repo: Path,
    python: str,
    only: list[str] | None = None,
    require_tree: bool = True,
) -> list[Result]:
    """Run every check (or those named in `only`); one (name, ok, output)
    per check, in the order of CHECKS.

    Each declared base's overlay is type-checked inside its patched tree
    (build/<version>/vllm-patched); without a tree mypy fails, unless
    `require_tree` is false (then the overlay is skipped, as in a pre-commit
    hook run before anything was built).
    """
    repo = repo.resolve()
    targets = _targets(repo)
    wanted = set(only or CHECKS)
    results: list[Result] = []
    if "ruff check" in wanted:
        ok, out = _run(
            [
                python,
                "-m",
                "ruff",
                "check",
                "--no-fix",
                "--output-format",
                "concise",
                *targets,
            ],
            repo,
        )
        results.append(("ruff check", ok, out))
    if "ruff format" in wanted:
        ok, out = _run([python, "-m", "ruff", "format", "--diff", *targets], repo)
        results.append(("ruff format", ok, out))
    if "mypy" in wanted:
        results.append(_mypy(repo, python, load_bases(), require_tree))
    if "typos" in wanted:
        # typos reads everything (docs, CI files); pyproject excludes patches/
        results.append(_typos(repo, python, ["."]))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m patchset_tool.lint",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("--repo", type=Path, default=Path.cwd())
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter whose ruff/mypy/typos to use",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=CHECKS,
        help="run only this check (repeatable)",
    )
    parser.add_argument(
        "--skip-missing-tree",
        action="store_true",
        help="without a patched tree, skip mypy on the overlay",
    )
    args = parser.parse_args(argv)
    results = run_lint(
        args.repo, args.python, args.only, require_tree=not args.skip_missing_tree
    )
    for name, ok, output in results:
        print(f"== {name}: {'ok' if ok else 'FAILED'}")
        if not ok or output.count("\n") < 3:
            print(output)
    failed = [name for name, ok, _ in results if not ok]
    if failed:
        print(f"lint failed: {', '.join(failed)}")
        return 1
    print("lint passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
