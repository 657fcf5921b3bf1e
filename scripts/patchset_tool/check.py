# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset check`: a fast offline consistency check that imports no vLLM.

From the full blob ids of `git format-patch --full-index` alone, it proves for
every base that consecutive patches chain and end at the overlay, and across
the bases that the series match by subject and order (unless `bases.toml`
declares a difference) and that each `[[same]]` file is one file everywhere.
"""

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from . import apply, envmgr, paths, upstream
from .bases import Base, declared_differences, declared_same, load_bases
from .digests import git_blob_id
from .distinfo import InstalledVllm, check_base, default_install
from .errors import PatchsetError
from .series import Patch, Series, read_series

SPDX = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
SUBJECT = re.compile(r"^\[[A-Za-z0-9 /._-]+\](\[[A-Za-z0-9 /._-]+\])* \S")
SIGNED_OFF = re.compile(r"^Signed-off-by: .+ <[^@\s]+@[^>\s]+>$", re.M)
NULL_BLOB = "0" * 40


def _check_header(patch: Patch) -> list[str]:
    problems = []
    if not SUBJECT.match(patch.subject):
        problems.append(
            f"subject '{patch.subject}' lacks a vLLM-style '[Area] ' prefix"
        )
    why = SIGNED_OFF.sub("", patch.body).strip()
    if len(why.split()) < 15:
        problems.append(
            "the body does not say why (under 15 words besides Signed-off-by)"
        )
    if not SIGNED_OFF.search(patch.body):
        problems.append("no 'Signed-off-by: Name <email>' line")
    return problems


def _check_results(
    base: Base, last: dict[str, str], new_files: frozenset[str]
) -> list[str]:
    problems = []
    for path, blob in last.items():
        copy = base.copy_of(path)
        if blob == NULL_BLOB:
            if copy.exists():
                problems.append(f"{copy}: the series deletes it, but it exists")
            continue
        if not copy.is_file():
            problems.append(f"{path}: changed by the series, missing at {copy}")
            continue
        data = copy.read_bytes()
        if git_blob_id(data) != blob:
            problems.append(
                f"{copy}: differs from the series' result "
                "(edited without `patchset refresh`?)"
            )
        if (
            path in new_files
            and path.endswith(".py")
            and not data.decode(errors="replace").startswith(SPDX)
        ):
            problems.append(f"{path}: new file without the SPDX header")
    for extra in paths.files_under(base.overlay):
        if extra.relative_to(base.overlay).as_posix() not in last:
            problems.append(f"{extra}: not part of any patch in the series")
    return problems


@contextlib.contextmanager
def base_files(series: Series, install: InstalledVllm) -> Iterator[Path]:
    """A scratch folder holding copies of the base files `series` modifies,
    after `apply`'s own checks of them (`check_base`: each matches RECORD,
    none outside the wheel is modified, none the series creates exists);
    removed on exit. `apply.apply_series_in` there is `apply` itself."""
    existing = check_base(install, series)
    with tempfile.TemporaryDirectory(prefix="patchset-check-") as tmp:
        root = Path(tmp)
        for rel in existing:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(install.site / rel, root / rel)
        yield root


def _check_base_files(series: Series) -> str:
    """Apply the series as `apply` does, with its parser and `git apply`,
    to the installed base files (RECORD-verified; when an environment
    exists) and compare the result with the overlay."""
    base = series.base
    if envmgr.env_python(base, require=False) is None:
        return "base files: not verified (no managed environment yet)"
    if series.source_files and not upstream.sdist_is_cached(base.version):
        return (
            "base files: not verified (the release's sdist, which holds "
            f"{len(series.source_files)} of them, is not cached; `apply` fetches it)"
        )
    install = default_install(base)
    with base_files(series, install) as root:
        apply.write_source_files(root, series)
        apply.apply_series_in(root, series)
    from_sdist = len(series.source_files)
    in_wheel = len(series.touched) - len(series.created) - from_sdist
    sdist = f" and {from_sdist} from its sdist" if from_sdist else ""
    return (
        f"base files: {in_wheel} match RECORD of vllm {install.version}{sdist}, "
        "and the series applies to them as `apply` applies it, giving the overlay"
    )


def check_base_series(base: Base) -> tuple[Series, list[str]]:
    """Check one base's series against its overlay; return the parsed
    series and notes, or raise listing every problem."""
    names = read_series(base.patches)
    problems = []
    for stray in sorted(base.patches.glob("*.patch")):
        if stray.name not in names:
            problems.append(f"{stray}: not listed in {base.series_file}")
    for number, name in enumerate(names, 1):
        if not name.startswith(f"{number:04d}-"):
            problems.append(
                f"{base.series_file}: entry {number} is {name}; "
                f"expected it to be numbered {number:04d}"
            )
    series = Series.load(base)
    for patch in series.patches:
        problems += [f"{patch.name}: {p}" for p in _check_header(patch)]
    chain_problems, last = series.blob_chain()
    problems += chain_problems + _check_results(base, last, series.created)
    if problems:
        raise PatchsetError(
            f"check failed for vLLM {base.version}:\n  " + "\n  ".join(problems)
        )
    notes = [
        (
            f"vLLM {base.version}: {len(series.patches)} patches, {len(last)} "
            f"files, {series.hunks} hunks: headers, blob chain, "
            "overlay, model tests and SPDX headers agree"
        ),
        f"vLLM {base.version}: " + _check_base_files(series),
    ]
    return series, notes


def _compare_subjects(series: dict[str, list[Patch]]) -> list[str]:
    """Every base carries the same patches by subject, in the same order,
    except subjects `bases.toml` declares as a difference."""
    declared = declared_differences()
    order = {
        version: [p.subject for p in patches if p.subject not in declared]
        for version, patches in series.items()
    }
    primary = next(iter(order))
    return [
        f"vLLM {version} carries {subjects}, but vLLM {primary} carries "
        f"{order[primary]} (declare an intended difference in bases.toml)"
        for version, subjects in order.items()
        if subjects != order[primary]
    ]


def _compare_same_files(bases: list[Base]) -> list[str]:
    """Each path `bases.toml` declares the same has one content in every
    base's overlay (which the series' result already equals)."""
    problems = []
    for path in declared_same():
        copies = {b.version: b.copy_of(path) for b in bases}
        missing = [v for v, copy in copies.items() if not copy.is_file()]
        if missing:
            problems.append(
                f"{path}: declared the same in every base, but vLLM "
                f"{', '.join(missing)} has no copy in its overlay"
            )
            continue
        blobs = {v: git_blob_id(copy.read_bytes()) for v, copy in copies.items()}
        if len(set(blobs.values())) > 1:
            problems.append(
                f"{path}: declared the same in every base ([[same]] in "
                "bases.toml), but the copies differ: "
                + ", ".join(f"vLLM {v} {blob[:12]}" for v, blob in blobs.items())
                + "; make the change in every base's series, or take the path "
                "out of [[same]]"
            )
    return problems


def check() -> list[str]:
    """Check every base's series; raise listing all problems, else return
    notes."""
    series: dict[str, list[Patch]] = {}
    notes: list[str] = []
    for base in load_bases():
        loaded, base_notes = check_base_series(base)
        series[base.version] = loaded.patches
        notes += base_notes
    problems = _compare_subjects(series) + _compare_same_files(load_bases())
    if problems:
        raise PatchsetError("check failed:\n  " + "\n  ".join(problems))
    notes.append(
        f"{len(series)} bases carry the same {len(next(iter(series.values())))} "
        "patches by subject, in order"
    )
    if same := declared_same():
        notes.append(f"{len(same)} files declared the same are one file in every base")
    return notes
