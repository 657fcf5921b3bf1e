# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's neighbouring tests: upstream's own test files outside
tests/models/glm5next/ that exercise what the series changes, declared in
ci/upstream_neighbours.txt.

For one base, they run from tests/ of the release checkout the model tests
use (`sourcetree.checkout_for_tests`) with the series applied and the
model tests' plugin for what this CPU host lacks. The files holding a test
that does not pass there run again on the pristine checkout, and the part
passes when each such test has the same outcome in both (a test that
passes patched is no regression; the log gives every skip's reason). In
the summary table, passed and skipped count the patched outcomes, failed
the differences; the log lists the tests that fail in both. A listed file
that the base does not have, or one marked `skip: REASON`, is not run; the
log says so.
"""

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from . import paths, sourcetree
from .bases import Base
from .errors import PatchsetError
from .junit import read_outcomes
from .series import Series

LIST = paths.REPO / "ci" / "upstream_neighbours.txt"
SKIP = "skip:"


@dataclass(frozen=True)
class Neighbour:
    path: str
    """The test file's path in vLLM's source tree (`tests/...`)."""
    skip: str | None = None
    """Why it is listed but not run here, if it is not."""


def load(path: Path | None = None) -> list[Neighbour]:
    """The declared files (in `path`, by default LIST): `PATH` or
    `PATH  skip: REASON` a line; # starts a comment."""
    path = path or LIST
    found = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        reason = rest[len(SKIP) :].strip() if rest.startswith(SKIP) else None
        if (
            not name.startswith("tests/")
            or not name.endswith(".py")
            or (rest and not reason)
        ):
            raise PatchsetError(
                f"{path}:{number}: expected `tests/...py` or "
                f"`tests/...py  skip: REASON`, got {raw.strip()!r}"
            )
        found.append(Neighbour(name, reason))
    return found


class Part(Protocol):
    """What this part needs of `testcmd.Part`."""

    passed: int
    failed: int
    skipped: int
    problems: list[str]
    log: Path | None


def _outcomes(part: Part, command: list[str], cwd: Path, env: dict[str, str]):
    """Run pytest `command`; each test's outcome (an error is a failure)."""
    assert part.log is not None
    with tempfile.TemporaryDirectory() as tmp, part.log.open("a") as log:
        xml = Path(tmp) / "junit.xml"
        command = [*command, f"--junitxml={xml}", "-o", "junit_family=xunit1"]
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        outcomes = read_outcomes(xml) if xml.exists() else {}
    return {n: "failed" if o == "error" else o for n, o in outcomes.items()}


def differences(pristine: dict[str, str], patched: dict[str, str]) -> list[str]:
    """One line per test whose outcome differs between the two runs."""
    return [
        f"{node}: {pristine.get(node, 'not run')} pristine, "
        f"{patched.get(node, 'not run')} patched"
        for node in sorted(pristine.keys() | patched.keys())
        if pristine.get(node) != patched.get(node)
    ]


def _summary(outcomes: dict[str, str]) -> str:
    counts = {
        o: list(outcomes.values()).count(o) for o in sorted(set(outcomes.values()))
    }
    return ", ".join(f"{n} {o}" for o, n in counts.items()) or "no test"


def _run(
    part: Part, python: Path, base: Base, checkout: Path, args: list[str], tree: str
) -> dict[str, str]:
    """Run pytest `args` from tests/ of `checkout`, `base`'s `tree`
    checkout, with what this CPU host lacks that a GPU runner has (the
    model tests' plugin); each test's outcome."""
    command = [str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    env = sourcetree.checkout_env(python, base, checkout, f"checkout-{tree}")
    command += sourcetree.cpu_host_plugin(env)
    # Without the Hub, a test that needs a model's config fails at once in
    # both trees instead of waiting on the network.
    env["HF_HUB_OFFLINE"] = "1"
    return _outcomes(part, [*command, *args], checkout / "tests", env)


def run_part(part: Part, python: Path, base: Base) -> None:
    """Run the declared files on `base`'s patched checkout, then those with
    a test that does not pass there on the pristine one, where each such
    test must have the same outcome."""
    assert part.log is not None
    neighbours = load()
    changed = Series.load(base).touched
    runnable = [n.path for n in neighbours if not n.skip and n.path not in changed]
    notes = [f"not run: {n.path}: {n.skip}" for n in neighbours if n.skip]
    notes += [
        f"not run: {n.path}: the series changes it (the model-test parts run it)"
        for n in neighbours
        if n.path in changed
    ]
    patched: dict[str, str] = {}
    with sourcetree.checkout_for_tests(base, patched=True) as checkout:
        present = [p for p in runnable if (checkout / p).is_file()]
        files = [p.removeprefix("tests/") for p in present]
        if present:
            patched = _run(part, python, base, checkout, files, "patched")
    notes += [f"not in vLLM {base.version}: {p}" for p in runnable if p not in present]
    if not present:
        part.problems.append(f"no declared file to run on {base.version}")
        return
    unsettled = {n: o for n, o in patched.items() if o != "passed"}
    pristine: dict[str, str] = {}
    if unsettled:
        # By file: a test id may not name the test to pytest (a class's), or
        # may exist in the patched tree only.
        ids = [n.removeprefix("tests/") for n in unsettled]
        again = [f for f in files if any(i.startswith(f[:-3]) for i in ids)]
        with sourcetree.checkout_for_tests(base, patched=False) as checkout:
            pristine = _run(part, python, base, checkout, again or files, "pristine")
    pristine = {n: o for n, o in pristine.items() if n in unsettled}
    both_failed = sorted(n for n, o in pristine.items() if o == "failed" == patched[n])
    with part.log.open("a") as log:
        for line in notes:
            log.write(f"note: {line}\n")
        log.write(f"patched: {_summary(patched)}\n")
        log.write(f"pristine, what does not pass patched: {_summary(pristine)}\n")
        log.write(f"failed in both trees: {len(both_failed)}\n")
        log.writelines(f"  {node}\n" for node in both_failed)
    if not patched:
        part.problems.append("pytest ran no test; see the log")
    diff = differences(pristine, unsettled)
    part.problems += [f"outcome differs: {d}" for d in diff]
    part.passed = list(patched.values()).count("passed")
    part.skipped = list(patched.values()).count("skipped")
    part.failed = len(diff)
