# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check that every test module is run by some CI step ("tethered").

This follows the rules of vLLM's `tools/pre_commit/check_test_tethering.py`
(v0.33.0), re-implemented here for this repository's layout:

* A test module is `tests/**/test_*.py` or `tests/**/*_test.py`, never
  `conftest.py` or `__init__.py`.
* It is tethered when a step's command runs pytest over a path that includes
  it: `pytest a/b c/d.py`, `python -m pytest ...`, `env X=1 timeout 60 pytest`,
  `find ROOT -name 'test_*.py' | xargs pytest`, `find ... -exec pytest {} +`,
  or a pytest line inside a `bash script.sh` that the step runs.
* `--ignore PATH` and `--ignore-glob GLOB` (a whole-path fnmatch, so `*`
  crosses `/`) remove files; a bare-path `--deselect PATH` removes that
  file, but `--deselect PATH::node` does not, nor do `-k` / `-m`.
* Every allowlist entry must give a non-empty reason; an allowlisted file
  that is now tethered, or that no longer exists, is reported too.

Unlike upstream, which strips a `tests/` prefix from every path, paths are
resolved against each step's working directory: `working_dir` if the step
sets one, otherwise upstream's default `/vllm-workspace/tests`, changed by
`cd DIR` within the step (a relative working_dir is from the checkout,
/vllm-workspace). Where the directory is unknown (a command string handed to
a runner script such as `run-cpu-test.sh "pytest tests/..."`, or `cd $DIR`),
a relative path may be from the checkout or from its tests/, upstream's
assumption. A CI path is mapped into this repository by taking it relative
to `/vllm-workspace/tests`, which corresponds to `step_workdir_root` here
(normally `tests/`): so `models/glm5next` in a command is
`tests/models/glm5next` in this repository.

Over vLLM v0.33.0's own .buildkite/ and tests/, this finds the same 186
untethered modules as upstream's checker.

The allowlist is YAML, a mapping from repository-relative test path to
reason:

    tests/models/glm5next/test_slow.py: needs 8 GPUs; run by hand

Usage: python -m patchset_tool.tethering --tests tests --steps ci/test_areas
       [--allowlist ci/tethering-allowlist.yaml]
"""

from __future__ import annotations

import argparse
import fnmatch
import posixpath
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The checkout in upstream's CI image, and where its Buildkite steps run
# unless they set `working_dir`.
CI_CHECKOUT = "/vllm-workspace"
DEFAULT_CI_WORKDIR = "/vllm-workspace/tests"

PYTEST_COMMANDS = {"pytest", "py.test"}
# Interpreters that run one file (or `-m pytest`).
FILE_RUNNERS = {"python", "python3", "torchrun", "coverage"}
# pytest options whose value is the next token (when not given with `=`).
PYTEST_VALUE_OPTIONS = {
    "-k", "-m", "-p", "-n", "-c", "-o", "-W", "-r",
    "--shard-id", "--num-shards", "--dist", "--durations", "--maxfail",
    "--timeout", "--rootdir", "--junitxml", "--tb", "--confcutdir",
    "--basetemp", "--log-level", "--import-mode",
}  # fmt: skip
XARGS_VALUE_OPTIONS = {
    "-n", "-L", "-P", "-s", "-I", "-i", "-J", "-E", "-d",
    "--max-args", "--max-lines", "--max-procs", "--replace", "--delimiter",
}  # fmt: skip
# Words that may precede the command that actually runs.
COMMAND_PREFIXES = {"if", "!", "then", "do", "time", "exec", "nice",
                    "command", "builtin"}  # fmt: skip
# Pipe stages that pass every line of a `find` through unchanged.
PASSTHROUGH_STAGES = {"sort", "tee", "cat", "tac"}
SHELL_OPERATOR_CHARS = set("|&;()<>")
LEADING_VAR = re.compile(r"^\$\{?\w+\}?/")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


# --------------------------------------------------------------------------
# Paths in CI space (absolute POSIX strings under /vllm-workspace)
# --------------------------------------------------------------------------


def _ci_paths(cwd: str | None, raw: str) -> list[str]:
    """Resolve a path as written in a command against the shell's cwd.

    Quotes and a `::node` suffix are dropped; a leading `$VAR/` is taken to
    be the checkout (`/vllm-workspace`), as upstream does. A cwd of None is
    unknown (a command string handed to a runner script, `cd $DIR`): then a
    relative path may be from the checkout or from its tests/, upstream's
    assumption for every command. Empty when the path cannot be known.
    """
    path = raw.strip().strip("'\"").split("::", 1)[0]
    if LEADING_VAR.match(path):
        path = LEADING_VAR.sub(CI_CHECKOUT + "/", path, count=1)
    if not path or "$" in path or path.startswith("~"):
        return []
    if path.startswith("/"):
        return [posixpath.normpath(path)]
    bases = [cwd] if cwd is not None else [CI_CHECKOUT, DEFAULT_CI_WORKDIR]
    return [posixpath.normpath(posixpath.join(b, path)) for b in bases]


def _within(parent: str, path: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _glob_covers(pattern: str, path: str) -> bool:
    """A positional glob argument, as the shell expands it: `*` stays within
    one path component (except in a `**` pattern), and a glob that names a
    directory covers what is below it."""
    if "**" in pattern:
        return fnmatch.fnmatchcase(path, pattern)
    pattern_parts = pattern.split("/")
    path_parts = path.split("/")
    return len(pattern_parts) <= len(path_parts) and all(
        fnmatch.fnmatchcase(part, glob) for part, glob in zip(path_parts, pattern_parts)
    )


def _has_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _arg_covers(arg: str, path: str) -> bool:
    return _within(arg, path) or (_has_glob(arg) and _glob_covers(arg, path))


@dataclass
class PytestSelection:
    """What one pytest invocation collects, as CI paths."""

    included: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    ignored_globs: list[str] = field(default_factory=list)

    def runs(self, path: str) -> bool:
        if not any(_arg_covers(arg, path) for arg in self.included):
            return False
        if any(_arg_covers(arg, path) for arg in self.ignored):
            return False
        # pytest matches --ignore-glob against the whole path with fnmatch.
        return not any(fnmatch.fnmatch(path, g) for g in self.ignored_globs)


@dataclass
class FindSelection:
    """A `find ROOT -name GLOB ...` whose hits all reach pytest."""

    root: str
    names: list[str] = field(default_factory=list)
    excluded_names: list[str] = field(default_factory=list)
    max_depth: int | None = None

    def runs(self, path: str) -> bool:
        if path == self.root or not _within(self.root, path):
            return False
        depth = path[len(self.root.rstrip("/")) :].strip("/").count("/") + 1
        if self.max_depth is not None and depth > self.max_depth:
            return False
        name = path.rsplit("/", 1)[-1]
        if self.names and not any(fnmatch.fnmatch(name, g) for g in self.names):
            return False
        return not any(fnmatch.fnmatch(name, g) for g in self.excluded_names)


Selection = PytestSelection | FindSelection


# --------------------------------------------------------------------------
# Parsing shell commands
# --------------------------------------------------------------------------


@dataclass
class _Shell:
    """State while reading the commands of one step."""

    mapper: _Mapper
    cwd: str | None
    visited: set[Path] = field(default_factory=set)
    variables: dict[str, str] = field(default_factory=dict)

    def child(self) -> _Shell:
        """A sub-shell: same cwd and variables, its own `cd`."""
        return _Shell(self.mapper, self.cwd, self.visited, dict(self.variables))


def _split_stages(command: str) -> list[tuple[str, list[str]]]:
    """Tokenise a shell line (quotes honoured) and split it at operators.

    Each stage is tagged with the operator before it ("" for the first).
    An untokenisable line yields nothing: missing coverage is the safe
    mistake, inventing it is not.
    """
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    stages: list[tuple[str, list[str]]] = [("", [])]
    in_exec = False
    for token in tokens:
        if in_exec and token in (";", "+"):
            stages[-1][1].append(token)
            in_exec = False
        elif token and set(token) <= SHELL_OPERATOR_CHARS:
            stages.append((token, []))
            in_exec = False
        else:
            stages[-1][1].append(token)
            in_exec = in_exec or token in ("-exec", "-execdir")
    return [(sep, words) for sep, words in stages if words or "(" in sep or ")" in sep]


def _command_index(tokens: list[str]) -> int:
    """Index of the word that runs, past `FOO=1`, `env`, `timeout`, ..."""
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if ENV_ASSIGNMENT.match(token) or token in COMMAND_PREFIXES:
            i += 1
        elif token == "env":
            i += 1
            while i < len(tokens) and (
                ENV_ASSIGNMENT.match(tokens[i]) or tokens[i].startswith("-")
            ):
                i += 1
        elif token == "timeout":
            i += 1
            while i < len(tokens) and tokens[i].startswith("-"):
                if tokens[i] in ("-k", "--kill-after", "-s", "--signal"):
                    i += 1
                i += 1
            i += 1  # the duration
        else:
            break
    return i


def _runs_pytest(tokens: list[str]) -> bool:
    i = _command_index(tokens)
    return i < len(tokens) and tokens[i] in PYTEST_COMMANDS


def _parse_pytest(tokens: list[str], shell: _Shell) -> PytestSelection:
    """Read the arguments after the `pytest` word."""
    selection = PytestSelection()
    start = next(i for i, t in enumerate(tokens) if t in PYTEST_COMMANDS)
    words = iter(tokens[start + 1 :])
    for token in words:
        option, has_eq, inline = token.partition("=")
        if option in ("--ignore", "--ignore-glob", "--deselect"):
            value = inline if has_eq else next(words, "")
            if option == "--deselect" and "::" in value:
                continue  # a node id: the file is still collected
            resolved = _ci_paths(shell.cwd, value)
            if option == "--ignore-glob":
                selection.ignored_globs.extend(resolved)
            else:
                selection.ignored.extend(resolved)
        elif token in PYTEST_VALUE_OPTIONS:
            next(words, None)
        elif token.startswith("-") or ENV_ASSIGNMENT.match(token):
            continue
        else:
            selection.included.extend(
                path
                for path in _ci_paths(shell.cwd, token)
                if shell.mapper.is_path_arg(token, path)
            )
    return selection


def _parse_find(tokens: list[str], shell: _Shell) -> list[FindSelection]:
    words = iter(tokens[tokens.index("find") + 1 :])
    root: str | None = None
    names: list[str] = []
    excluded: list[str] = []
    max_depth: int | None = None
    negate = False
    for token in words:
        if token in ("-not", "!"):
            negate = True
            continue
        if token in ("-name", "-iname"):
            (excluded if negate else names).append(next(words, ""))
        elif token == "-maxdepth":
            value = next(words, "")
            max_depth = int(value) if value.isdigit() else None
        elif token in ("-exec", "-execdir"):
            break
        elif root is None and not token.startswith("-"):
            root = token
        negate = False
    if root is None:
        return []
    return [
        FindSelection(path, names, excluded, max_depth)
        for path in _ci_paths(shell.cwd, root)
    ]


def _exec_runs_pytest(action: list[str], shell: _Shell) -> bool:
    """`-exec pytest ... {} ;` (or `+`) with `{}` as a positional path."""
    if not action or action[0] not in PYTEST_COMMANDS:
        return False
    if ";" not in action and "+" not in action:
        return False
    end = min(action.index(t) for t in (";", "+") if t in action)
    probe = [t.replace("{}", "/__find_hit__.py") for t in action[:end]]
    selection = _parse_pytest(probe, shell)
    return "/__find_hit__.py" in selection.included


def _xargs_target(tokens: list[str]) -> list[str]:
    i = 0
    while i < len(tokens):
        if tokens[i] in XARGS_VALUE_OPTIONS:
            i += 2
        elif tokens[i].startswith("-"):
            i += 1
        else:
            return tokens[i:]
    return []


def _find_feeds_pytest(
    stages: list[tuple[str, list[str]]], index: int, shell: _Shell
) -> bool:
    tokens = stages[index][1]
    for i, token in enumerate(tokens):
        if token in ("-exec", "-execdir") and _exec_runs_pytest(tokens[i + 1 :], shell):
            return True
    for sep, words in stages[index + 1 :]:
        if sep != "|" or not words:
            return False
        if words[0] == "xargs":
            return _runs_pytest(_xargs_target(words[1:]))
        if words[0] not in PASSTHROUGH_STAGES:
            return False
    return False


def _dash_c_code(tokens: list[str]) -> str | None:
    """The code string of `bash -c CODE` / `sh -ec CODE`, else None."""
    for i, token in enumerate(tokens[1:], start=1):
        if not token.startswith("-"):
            return None
        if not token.startswith("--") and "c" in token[1:]:
            return tokens[i + 1] if i + 1 < len(tokens) else None
    return None


def _run_script(tokens: list[str], shell: _Shell) -> list[Selection]:
    """Follow `bash path/to/script.sh` (or `./script.sh`) into the script."""
    script = next((t for t in tokens if t.endswith(".sh")), None)
    if script is None:
        return []
    candidates = [shell.mapper.to_repo(p) for p in _ci_paths(shell.cwd, script)]
    # As upstream: also try the path from the checkout's root.
    stripped = script.strip("'\"").replace("/vllm-workspace/", "")
    candidates.append(
        shell.mapper.to_repo(
            posixpath.join("/vllm-workspace", stripped.removeprefix("./"))
        )
    )
    path = next((p for p in candidates if p.is_file()), None)
    if path is None or path.resolve() in shell.visited:
        return []
    shell.visited.add(path.resolve())
    # The script runs in a child process: its `cd` does not leak out.
    inner = shell.child()
    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    selections: list[Selection] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assignment = re.fullmatch(r"(\w+)=(\S+)", line)
        if assignment:
            inner.variables[assignment[1]] = assignment[2].strip("'\"")
            continue
        selections.extend(parse_command(line, inner))
    return selections


def _expand(line: str, variables: dict[str, str]) -> str:
    """Substitute known `$VAR` / `${VAR}` outside single quotes."""

    def substitute(segment: str) -> str:
        return re.sub(
            r"\$\{(\w+)\}|\$(\w+)",
            lambda m: variables.get(m[1] or m[2], m[0]),
            segment,
        )

    parts = line.split("'")
    return "'".join(substitute(p) if i % 2 == 0 else p for i, p in enumerate(parts))


def _classify(tokens: list[str], shell: _Shell) -> list[Selection]:
    """The selections one stage (a simple command) implies."""
    if "find" in tokens and any(t in ("-name", "-iname") for t in tokens):
        return list(_parse_find(tokens, shell))
    if _runs_pytest(tokens):
        return [_parse_pytest(tokens, shell)]
    index = _command_index(tokens)
    if index >= len(tokens):
        return []
    word = tokens[index].rsplit("/", 1)[-1]
    rest = tokens[index + 1 :]
    if word in ("bash", "sh") or word.endswith(".sh"):
        code = _dash_c_code(tokens[index:]) if word in ("bash", "sh") else None
        if code is not None:
            return parse_command(code, shell.child())
        selections = _run_script(tokens[index:], shell)
        # Runner scripts that take whole commands as quoted arguments; where
        # the script runs them (a container, say) is not known.
        for arg in rest:
            if " " in arg and any(
                w in PYTEST_COMMANDS | FILE_RUNNERS for w in arg.split()
            ):
                runner = shell.child()
                runner.cwd = None
                selections.extend(parse_command(arg, runner))
        return selections
    if word in FILE_RUNNERS:
        if "-c" in rest:
            before = rest[: rest.index("-c")]
            if "-m" not in before and not any(t.endswith(".py") for t in before):
                return []
        if "-m" in rest:
            after = rest[rest.index("-m") + 1 :]
            if after[:1] and after[0] in PYTEST_COMMANDS:
                return [_parse_pytest(after, shell)]
            return []
        for token in rest:
            if token.endswith(".py"):
                return [PytestSelection(included=_ci_paths(shell.cwd, token))]
    return []


def _change_directory(tokens: list[str], shell: _Shell) -> bool:
    """Apply `cd DIR` / `pushd DIR`; True if the stage was one."""
    if not tokens or tokens[0] not in ("cd", "pushd"):
        return False
    target = next((t for t in tokens[1:] if not t.startswith("-")), None)
    paths = [] if target is None else _ci_paths(shell.cwd, target)
    # An unknown directory, or one of two candidates, leaves cwd unknown.
    shell.cwd = paths[0] if len(paths) == 1 else None
    return True


def parse_command(command: str, shell: _Shell) -> list[Selection]:
    """The selections one command line implies; `cd` updates `shell`."""
    if shell.variables:
        command = _expand(command, shell.variables)
    stages = _split_stages(command)
    saved: list[str | None] = []
    selections: list[Selection] = []
    for index, (sep, tokens) in enumerate(stages):
        if "(" in sep:
            saved.append(shell.cwd)
        if ")" in sep and saved:
            shell.cwd = saved.pop()
        if _change_directory(tokens, shell):
            continue
        for selection in _classify(tokens, shell):
            if isinstance(selection, FindSelection) and not _find_feeds_pytest(
                stages, index, shell
            ):
                continue
            selections.append(selection)
    return selections


# --------------------------------------------------------------------------
# Steps, inventory, allowlist
# --------------------------------------------------------------------------


@dataclass
class _Mapper:
    """Maps CI paths under /vllm-workspace onto this repository."""

    workdir_root: Path

    def to_repo(self, ci_path: str) -> Path:
        rel = posixpath.relpath(ci_path, DEFAULT_CI_WORKDIR)
        return Path(
            posixpath.normpath(posixpath.join(self.workdir_root.as_posix(), rel))
        )

    def to_ci(self, repo_path: Path) -> str:
        rel = Path(repo_path).resolve().relative_to(self.workdir_root.resolve())
        return posixpath.normpath(posixpath.join(DEFAULT_CI_WORKDIR, rel.as_posix()))

    def is_path_arg(self, token: str, resolved: str) -> bool:
        """A token with `/` or `.py` is a path; a bare word only if it
        names a directory (so `-m` values and the like are not)."""
        if "/" in token or token.endswith(".py") or _has_glob(token):
            return True
        return self.to_repo(resolved).is_dir()


def _yaml_files(step_files: list[Path]) -> list[Path]:
    files: list[Path] = []
    for entry in step_files:
        if entry.is_dir():
            files.extend(sorted([*entry.glob("*.yaml"), *entry.glob("*.yml")]))
        else:
            files.append(entry)
    return files


def _steps(doc: Any) -> Iterator[dict[str, Any]]:
    """Every step, group members included, and each `mirror` variant merged
    over its step (a mirror may change commands or working_dir)."""
    items = doc.get("steps") if isinstance(doc, dict) else doc
    for step in items or []:
        if not isinstance(step, dict):
            continue
        if "steps" in step:
            yield from _steps(step)
            continue
        yield step
        for variant in (step.get("mirror") or {}).values():
            if isinstance(variant, dict):
                merged = {**step, **variant}
                merged.pop("mirror", None)
                yield merged


def _step_commands(step: dict[str, Any]) -> list[str]:
    commands: list[str] = []
    for key in ("commands", "command"):
        value = step.get(key)
        if isinstance(value, str):
            commands.append(value)
        elif isinstance(value, list):
            commands.extend(c for c in value if isinstance(c, str))
    return commands


def load_selections(
    step_files: list[Path], step_workdir_root: Path
) -> tuple[list[Selection], list[str]]:
    """Parse every step file; returns (selections, errors)."""
    mapper = _Mapper(step_workdir_root)
    selections: list[Selection] = []
    errors: list[str] = []
    for path in _yaml_files(step_files):
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            errors.append(f"error: {path}: cannot read steps: {exc}")
            continue
        for step in _steps(doc):
            # A relative working_dir is from the checkout.
            workdir = str(step.get("working_dir") or DEFAULT_CI_WORKDIR)
            cwd = posixpath.normpath(posixpath.join(CI_CHECKOUT, workdir))
            # Buildkite runs a step's commands in one shell: `cd` persists.
            shell = _Shell(mapper, cwd)
            for command in _step_commands(step):
                selections.extend(parse_command(command, shell))
    return selections, errors


def is_test_module(path: Path) -> bool:
    name = path.name
    if not name.endswith(".py") or name in ("conftest.py", "__init__.py"):
        return False
    return name.startswith("test_") or name.endswith("_test.py")


def test_modules(test_root: Path) -> list[Path]:
    return sorted(
        p
        for p in test_root.rglob("*.py")
        if is_test_module(p)
        and "__pycache__" not in p.parts
        and not any(part.startswith(".") for part in p.relative_to(test_root).parts)
    )


def load_allowlist(path: Path) -> tuple[dict[str, str], list[str]]:
    """Read the allowlist; returns (path -> reason, errors)."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        return {}, [f"error: {path}: cannot read the allowlist: {exc}"]
    if doc is None:
        return {}, []
    if not isinstance(doc, dict):
        return {}, [f"error: {path}: must be a mapping of test path to reason"]
    entries: dict[str, str] = {}
    errors: list[str] = []
    for key, reason in doc.items():
        name = str(key).strip()
        if not isinstance(reason, str) or not reason.strip():
            errors.append(
                f"error: {path}: {name} has no reason; say why it "
                "cannot be run by a CI step"
            )
            continue
        entries[posixpath.normpath(name)] = reason.strip()
    return entries, errors


def _display(path: Path, base: Path) -> str:
    try:
        return path.resolve().relative_to(base.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def check(
    test_root: Path,
    step_files: list[Path],
    allowlist: Path | None,
    step_workdir_root: Path,
) -> list[str]:
    """Return one message per problem; an empty list means all tethered.

    `test_root` holds the test modules (normally `tests/`); `step_files` are
    step YAML files or directories of them; `step_workdir_root` is the
    directory here that a step's default working directory
    (/vllm-workspace/tests) stands for. Paths in messages and in the
    allowlist are relative to the parent of `test_root` (the repository).
    """
    base = test_root.resolve().parent
    mapper = _Mapper(step_workdir_root)
    selections, messages = load_selections(step_files, step_workdir_root)
    allowed: dict[str, str] = {}
    if allowlist is not None:
        allowed, errors = load_allowlist(allowlist)
        messages.extend(errors)

    where = ", ".join(p.as_posix() for p in step_files)

    def tethered(path: Path) -> bool:
        try:
            ci_path = mapper.to_ci(path)
        except ValueError:
            return False  # outside what any step can reach
        return any(selection.runs(ci_path) for selection in selections)

    for module in test_modules(test_root):
        rel = _display(module, base)
        if rel in allowed:
            if tethered(module):
                messages.append(
                    f"error: {rel} is allowlisted but now "
                    "tethered; remove it from the allowlist"
                )
            continue
        if not tethered(module):
            messages.append(
                f"error: {rel} is not run by any CI step in {where}; add "
                "it to a step's commands (and source_file_dependencies) or "
                "to the allowlist with a reason"
            )
    for rel in sorted(allowed):
        if not (base / rel).is_file():
            messages.append(
                f"error: {rel} is allowlisted but does not "
                "exist; remove it from the allowlist"
            )
    return messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m patchset_tool.tethering",
        description="Check that every test module is run by a CI step.",
    )
    parser.add_argument(
        "--tests",
        type=Path,
        default=Path("tests"),
        help="directory of test modules (default: tests)",
    )
    parser.add_argument(
        "--steps",
        type=Path,
        nargs="+",
        default=[Path("ci/test_areas")],
        help="step YAML files or directories (default: ci/test_areas)",
    )
    parser.add_argument(
        "--allowlist",
        type=Path,
        default=None,
        help="YAML mapping of test path to reason",
    )
    parser.add_argument(
        "--workdir-root",
        type=Path,
        default=None,
        help="the directory a step's default working dir "
        f"({DEFAULT_CI_WORKDIR}) maps to "
        "(default: --tests)",
    )
    args = parser.parse_args(argv)
    messages = check(
        args.tests, args.steps, args.allowlist, args.workdir_root or args.tests
    )
    for message in messages:
        print(message)
    if messages:
        print(f"\ntest tethering: {len(messages)} problem(s)")
        return 1
    print("test tethering: every test module is run by a CI step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
