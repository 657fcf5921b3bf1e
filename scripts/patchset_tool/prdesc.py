# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pull-request description of one exported patch, written from data.

Sources, read every time (nothing about a patch is written here):

- the patch: its subject (the title), its message (overview, design, related
  threads, the figures it claims), its diff (the file table, the tests);
- `docs/measurements.md`: every figure a claim may carry, cited by section;
  a section belongs to a patch when its heading, or the paragraph before a
  table, names the patch ("patch 0001"), or when its tables hold at least
  `DISTINCT_MATCHES` of the figures the patch's message gives;
- `README.md`: the recommended configuration (its sections that belong to
  the patch by the same rule) and the limits of what was run;
- the latest logs of `scripts/patchset test` (`build/test-logs/`), read for
  each test's outcome on the release and with the series, cross-checked with
  `patches/<version>/expected-base-failures.txt`; the neighbours' log; the
  H200 results that `gpu --collect` brought back, if any.

A figure that neither a measurements section nor a log holds is left out
(`Description.untraced` names it); a source that is missing is written as
"not run". `check` validates any description against the same sources.
"""

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path

from .junit import read_node_list, read_outcomes
from .series import Patch

SECTIONS = ("Overview", "Claims", "Validation", "Details")
"""The headings of vLLM's PR template this module fills, in its order."""
DISTINCT_MATCHES = 3
TRIVIAL_BELOW = 100
"""Plain integers below this need no source (counts of layers, heads,
tests); a decimal, a percentage or a ratio (`x`) always does."""
PLACEHOLDER = re.compile(r"@[\w.-]*\.example\b|\bSeed [0-9a-f]{8} maintainers\b")
NUMBER = re.compile(
    r"(?<![\w.#/@:\[])(?<![A-Za-z]-)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?"
    r"((?:x|K|M|%|B|GiB|MiB|GB|MB|us|µs|ms|s)?)(?![\w]|\.\d|-[A-Za-z])"
)
THREAD = re.compile(r"(?<![\w&])#(\d{4,6})\b")
SIGNOFF = re.compile(r"^\s*Signed-off-by:", re.I)
BLOCK_START = re.compile(r"^(\s*[-*+] |\s*\d+[.)] |#|>|\||    |\t|<|```)")
STATUS = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
LOG_TOKEN = re.compile(
    r"(?P<node>[\w/.-]+\.py::\S+)|(?P<status>\b(?:" + "|".join(STATUS) + r")\b)"
)
PATCH_REF = re.compile(r"\bpatch(?:es)? (\d{4})\b", re.I)


# ---------------------------------------------------------------- text


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


def numbers(text: str) -> list[str]:
    """The figures in `text` (prose: code spans and blocks left out)."""
    prose = re.sub(r"```.*?```", " ", text, flags=re.S)
    prose = re.sub(r"`[^`\n]*`", " ", prose)
    prose = re.sub(r"\b\d+(?:\.\d+){2,}\b", " ", prose)  # versions
    return [
        m.group(1) + (m.group(2) or "") + m.group(3) for m in NUMBER.finditer(prose)
    ]


def _value(figure: str) -> Decimal | None:
    try:
        return abs(Decimal(re.sub(r"[^\d.]", "", figure)))
    except InvalidOperation:
        return None


def is_trivial(figure: str) -> bool:
    value = _value(figure)
    if value is None:
        return True
    plain = figure[-1].isdigit() and "." not in figure
    return plain and value < TRIVIAL_BELOW


def is_distinctive(figure: str) -> bool:
    """A figure unlikely to match by chance: a decimal or 3+ digits."""
    return "." in figure or len(re.sub(r"\D", "", figure)) >= 3


class Pool:
    """Figures that sources hold, each with where it comes from."""

    def __init__(self) -> None:
        self.where: dict[Decimal, str] = {}

    def add(self, text_or_figures: str | list[str], source: str) -> None:
        figures = (
            numbers(text_or_figures)
            if isinstance(text_or_figures, str)
            else text_or_figures
        )
        for figure in figures:
            value = _value(figure)
            if value is not None:
                self.where.setdefault(value, source)

    def source_of(self, figure: str) -> str | None:
        """The source holding `figure`, itself or rounded to its precision."""
        value = _value(figure)
        if value is None:
            return None
        if value in self.where:
            return self.where[value]
        if figure.endswith("K"):
            for scale in (1000, 1024):
                if value * scale in self.where:
                    return self.where[value * scale]
        places = Decimal(1).scaleb(value.as_tuple().exponent)  # type: ignore[arg-type]
        for held, source in self.where.items():
            if held.quantize(places, rounding="ROUND_HALF_UP") == value:
                return source
        return None


# ------------------------------------------------------ markdown sources


@dataclass
class Table:
    lines: list[str]
    before: str
    """The paragraph just before the table."""

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass
class Section:
    """A heading of a markdown file and what follows it, to the next one."""

    path: str
    title: str
    level: int
    lines: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    code: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    @property
    def cite(self) -> str:
        return f'{self.path}, "{self.title}"'

    def paragraphs(self) -> list[str]:
        """Prose paragraphs and list items, unwrapped (no tables or code)."""
        out, in_code = [], False
        for block in unwrap(self.text).split("\n"):
            if block.lstrip().startswith("```"):
                in_code = not in_code
            elif not in_code and block.strip() and not block.startswith("|"):
                out.append(block.strip())
        return out


def read_sections(path: Path, label: str) -> list[Section]:
    """`path`'s sections (tables, code blocks and text of each heading)."""
    if not path.is_file():
        return []
    sections = [Section(label, "", 0)]
    in_code, last = False, ""
    code: list[str] = []
    paragraph: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if in_code:
                sections[-1].code.append("\n".join(code))
                code = []
            in_code = not in_code
        elif in_code:
            code.append(line)
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            sections.append(Section(label, line.lstrip("#").strip(), level))
            paragraph, last = [], ""
            continue
        elif line.startswith("|"):
            tables = sections[-1].tables
            previous = sections[-1].lines[-1] if sections[-1].lines else ""
            if previous.startswith("|") and tables:
                tables[-1].lines.append(line)
            else:
                tables.append(Table([line], " ".join(paragraph) or last))
        elif line.strip():
            paragraph.append(line.strip())
        else:
            last, paragraph = " ".join(paragraph) or last, []
        sections[-1].lines.append(line)
    return sections


def patch_number(patch: Patch) -> str:
    return patch.name[:4]


def belongs(section: Section, table_or_text: str, before: str, patch: Patch) -> bool:
    """Whether a section's table (or text) is evidence for `patch`."""
    named = PATCH_REF.findall(section.title) or PATCH_REF.findall(before)
    if named:
        return patch_number(patch) in named
    claimed = {f for f in numbers(patch.body) if is_distinctive(f)}
    held = Pool()
    held.add(table_or_text, "")
    matched = {f for f in claimed if held.source_of(f) is not None}
    return len(matched) >= DISTINCT_MATCHES


# ------------------------------------------------------------- logs


@dataclass
class Run:
    """One log of the test command, read."""

    path: Path
    outcomes: dict[str, str]
    when: str

    @property
    def cite(self) -> str:
        return f"`{self.path.name}` ({self.when})"


def _when(path: Path) -> str:
    stamp = datetime.fromtimestamp(path.stat().st_mtime, UTC)
    return stamp.strftime("%Y-%m-%d %H:%M UTC")


def read_log(path: Path) -> Run | None:
    """Each test's outcome in a pytest `-v` log (node ids as upstream's
    tests/ folder names them, `tests/` prefixed); None without a log."""
    if not path.is_file():
        return None
    text = path.read_text(errors="replace").split("short test summary info")[0]
    outcomes: dict[str, str] = {}
    pending: str | None = None
    for match in LOG_TOKEN.finditer(text):
        if match.group("node"):
            pending = match.group("node")
        elif pending:
            node = pending if pending.startswith("tests/") else f"tests/{pending}"
            outcomes[node] = match.group("status").lower()
            pending = None
    return Run(path, outcomes, _when(path)) if outcomes else None


@dataclass
class Sources:
    """Where the evidence for one base lives (see the module docstring)."""

    version: str
    measurements: Path
    readme: Path
    pristine_log: Path
    patched_log: Path
    neighbours_log: Path
    neighbours_list: Path
    expected_failures: Path
    gpu_results: Path
    sm90_pristine_log: Path | None = None
    sm90_patched_log: Path | None = None


def rel(path: Path) -> str:
    parts = path.parts
    for anchor in ("build", "docs", "patches", "ci"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor) - 1 :])
    return path.name


@dataclass
class Evidence:
    """Everything read from the sources, once per export."""

    sources: Sources
    measurements: list[Section]
    readme: list[Section]
    pristine: Run | None
    patched: Run | None
    expected: set[str]
    neighbours: str | None
    gpu: dict[str, str] | None
    gpu_device: str
    sm90_pristine: Run | None = None
    sm90_patched: Run | None = None
    gpu_step: dict[str, dict[str, str]] | None = None

    @classmethod
    def read(cls, sources: Sources) -> "Evidence":
        gpu = _junit(sources.gpu_results / "junit.xml")
        runs = {t: _junit(sources.gpu_results / f"junit-{t}.xml") for t in TREES}
        step = {t: o for t, o in runs.items() if o is not None}
        info = sources.gpu_results / "device.txt"
        lines = info.read_text(errors="replace").splitlines() if info.is_file() else []
        device = lines[0] if lines else ""
        neighbours = (
            sources.neighbours_log.read_text(errors="replace")
            if sources.neighbours_log.is_file()
            else None
        )
        return cls(
            sources,
            read_sections(sources.measurements, "docs/measurements.md"),
            read_sections(sources.readme, "README.md"),
            read_log(sources.pristine_log),
            read_log(sources.patched_log),
            read_node_list(sources.expected_failures),
            neighbours,
            gpu,
            device.strip(),
            read_log(sources.sm90_pristine_log) if sources.sm90_pristine_log else None,
            read_log(sources.sm90_patched_log) if sources.sm90_patched_log else None,
            step if len(step) == len(TREES) else None,
        )

    def pool(self, patch: Patch | None = None) -> Pool:
        """Every figure the sources hold; with `patch`, only the
        measurements sections that belong to it, and the logs."""
        pool = Pool()
        for section in self.measurements:
            if patch is None or belongs(section, section.text, "", patch):
                pool.add(section.text, section.cite)
                continue
            for table in section.tables:
                if belongs(section, table.text, table.before, patch):
                    pool.add(f"{table.before}\n{table.text}", section.cite)
        for run in (self.pristine, self.patched):
            if run:
                for figure in _log_figures(run):
                    pool.add([figure], f"build/test-logs/{run.path.name}")
        if self.neighbours:
            pool.add(
                " ".join(
                    line
                    for line in self.neighbours.splitlines()
                    if not line.startswith("$")
                ),
                rel(self.sources.neighbours_log),
            )
        if self.gpu is not None:
            pool.add(_count_figures(self.gpu), rel(self.sources.gpu_results))
        if self.gpu_step is not None:
            pool.add(self.gpu_device, rel(self.sources.gpu_results / "device.txt"))
            for outcomes in self.gpu_step.values():
                pool.add(_file_figures(outcomes), rel(self.sources.gpu_results))
        return pool


def _count_figures(outcomes: dict[str, str]) -> list[str]:
    values = list(outcomes.values())
    return [str(len(values))] + [str(values.count(o)) for o in set(values)]


def _log_figures(run: Run) -> list[str]:
    """The counts a log gives: over all tests and per test file."""
    return _file_figures(run.outcomes)


def _file_figures(outcomes: dict[str, str]) -> list[str]:
    """The counts of `outcomes`: over all tests and per test file."""
    figures = _count_figures(outcomes)
    files: dict[str, dict[str, str]] = {}
    for node, outcome in outcomes.items():
        files.setdefault(node.split("::")[0], {})[node] = outcome
    for per_file in files.values():
        figures += _count_figures(per_file)
    return figures


# ------------------------------------------------------------- the patch


@dataclass
class FileChange:
    path: str
    added: int = 0
    removed: int = 0
    new: bool = False


def file_changes(patch: Patch) -> list[FileChange]:
    """Lines added and removed per file, from the patch's diff."""
    changes: list[FileChange] = []
    in_hunk = False
    for line in patch.path.read_text().split("\n"):
        if line.startswith("diff --git "):
            changes.append(FileChange(line.split(" b/", 1)[1]))
            in_hunk = False
        elif not changes:
            continue
        elif line.startswith("new file mode"):
            changes[-1].new = True
        elif line.startswith("@@"):
            in_hunk = True
        elif in_hunk and line.startswith("+"):
            changes[-1].added += 1
        elif in_hunk and line.startswith("-"):
            changes[-1].removed += 1
        elif line == "-- ":
            break
    return changes


def message(patch: Patch) -> str:
    """The commit message without its Signed-off-by lines."""
    kept = [line for line in patch.body.splitlines() if not SIGNOFF.match(line)]
    return "\n".join(kept).strip()


def units(text: str) -> list[str]:
    """The paragraphs and list items of a commit message, unwrapped."""
    out: list[str] = []
    for block in re.split(r"\n\s*\n", unwrap(text)):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        out += lines
    return out


def sentences(unit: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.;])\s+(?=[A-Z(])", unit) if s]


def test_files(patch: Patch) -> list[str]:
    """The test files (tests/.../test_*.py) the patch adds or changes."""
    return [
        f.path
        for f in patch.files
        if f.path.startswith("tests/")
        and Path(f.path).name.startswith("test_")
        and f.path.endswith(".py")
        and not f.is_deleted
    ]


# ------------------------------------------------------------ writing


@dataclass
class Branch:
    """What the description says of the branch a patch is exported to."""

    name: str
    base: str
    """`the release` or the name of the branch it is stacked on."""
    stacked_on: Patch | None
    reason: str


@dataclass
class Description:
    title: str
    text: str
    untraced: list[str]
    not_run: list[str]


def _traced(text: str, pool: Pool) -> tuple[bool, list[str], list[str]]:
    """(every non-trivial figure traced, their sources, the untraced)."""
    cited, missing = [], []
    for figure in numbers(text):
        if is_trivial(figure):
            continue
        source = pool.source_of(figure)
        if source is None:
            missing.append(figure)
        elif source not in cited:
            cited.append(source)
    return not missing, cited, missing


class Writer:
    """Writes one patch's description from the evidence."""

    def __init__(self, patch: Patch, evidence: Evidence, branch: Branch) -> None:
        self.patch, self.evidence, self.branch = patch, evidence, branch
        self.pool = evidence.pool(patch)
        self.untraced: list[str] = []
        self.not_run: list[str] = []
        self.version = evidence.sources.version
        self.units = units(message(patch))

    def keep(self, text: str) -> str | None:
        """`text` if all its figures trace; else None, noting them."""
        ok, _, missing = _traced(text, self.pool)
        if not ok:
            self.untraced += [f"{f} ({text[:60]}...)" for f in missing]
            return None
        return text

    # Overview --------------------------------------------------------
    def overview(self) -> str:
        first = next((u for u in self.units if not u.startswith("-")), "")
        rest = [u for u in self.units[1:] if not u.startswith(("-", "Test"))]
        change = sentences(rest[0])[0] if rest else ""
        parts = [p for p in (self.keep(first), self.keep(change)) if p]
        threads = sorted(set(THREAD.findall(self.patch.body)), key=int)
        lines = [" ".join(parts)]
        if threads:
            lines += ["", "Related: " + ", ".join(f"#{t}" for t in threads)]
        if self.branch.stacked_on is not None:
            lines += [
                "",
                (
                    f"**Stacked on `{self.branch.base}`** "
                    f"({self.branch.stacked_on.subject}): {self.branch.reason}. "
                    "Review and merge that one first; this PR's own commit is "
                    "the last one."
                ),
            ]
        else:
            lines += [
                "",
                f"Based on vLLM v{self.version} alone: {self.branch.reason}.",
            ]
        return "\n".join(lines)

    # Claims ----------------------------------------------------------
    def tables(self) -> list[tuple[Section, Table]]:
        found = []
        for section in self.evidence.measurements:
            for table in section.tables:
                if belongs(section, table.text, table.before, self.patch):
                    found.append((section, table))
        return found

    def claims(self) -> str:
        bullets = []
        for unit in self.units[1:]:
            figures = [f for f in numbers(unit) if not is_trivial(f)]
            if not figures:
                continue
            kept, cited = [], []
            for sentence in sentences(unit.lstrip("- ")):
                ok, sources, missing = _traced(sentence, self.pool)
                if ok and any(not is_trivial(f) for f in numbers(sentence)):
                    kept.append(sentence)
                    cited += [s for s in sources if s not in cited]
                elif missing:
                    self.untraced += [f"{f} ({sentence[:60]}...)" for f in missing]
            if kept:
                bullets.append(f"- {' '.join(kept)} (source: {'; '.join(cited)})")
        red_green = self.red_green_counts()
        if red_green:
            bullets.append(f"- {red_green}")
        lines = bullets or ["- No figure of this change is held by a source."]
        tables = self.tables()
        if tables:
            lines += ["", "Figures behind these claims:"]
            for section, table in tables:
                lines += [
                    "",
                    "<details>",
                    f"<summary>{section.cite}</summary>",
                    "",
                    *[p for p in [unwrap(table.before)] if p and self.keep(p)],
                    "",
                    table.text,
                    "",
                    "</details>",
                ]
        return "\n".join(lines)

    # Validation ------------------------------------------------------
    def mine(self, run: Run | None) -> dict[str, str]:
        files = set(test_files(self.patch))
        if run is None:
            return {}
        return {n: o for n, o in run.outcomes.items() if n.split("::")[0] in files}

    def red_green_counts(self) -> str:
        pristine, patched = (
            self.mine(self.evidence.pristine),
            self.mine(self.evidence.patched),
        )
        if not pristine or not patched:
            return ""
        red = sorted(n for n, o in pristine.items() if o == "failed")
        green = [n for n in red if patched.get(n) == "passed"]
        return (
            f"{len(green)} of the {len(patched)} tests this change adds or "
            f"changes fail on vLLM {self.version} and pass with it; "
            f"{sum(o == 'passed' for o in patched.values())} of "
            f"{len(patched)} pass with it (source: "
            f"build/test-logs/{self.evidence.pristine.path.name}, "  # type: ignore[union-attr]
            f"build/test-logs/{self.evidence.patched.path.name})"  # type: ignore[union-attr]
        )

    def validation(self) -> str:
        files = test_files(self.patch)
        lines = ["Unit tests, run from `tests/` as upstream's CI runs them:", ""]
        lines += ["```bash", "cd tests"]
        lines += [f"pytest -v -s {f.removeprefix('tests/')}" for f in files]
        lines += ["```", ""]
        ev = self.evidence
        pristine, patched = self.mine(ev.pristine), self.mine(ev.patched)
        expected = {n for n in ev.expected if n.split("::")[0] in files}
        if not pristine:
            self.not_run.append(f"the tests on vLLM {self.version} (no log)")
            lines.append(
                f"On vLLM {self.version} without this change: not run "
                f"(no `{rel(ev.sources.pristine_log)}`; `scripts/patchset "
                f"test --base {self.version}` writes it)."
            )
        else:
            red = sorted(n for n, o in pristine.items() if o == "failed")
            both = [n for n in red if n in expected]
            lines.append(
                f"On vLLM {self.version} without this change "
                f"({ev.pristine.cite}), {len(red)} of these "  # type: ignore[union-attr]
                f"{len(pristine)} tests fail, as `{rel(ev.sources.expected_failures)}` "
                f"lists them ({len(both)} of its {len(expected)} entries for "
                "these files):"
            )
            lines += ["", "```"] + [f"FAILED {n}" for n in red] + ["```"]
            for node in sorted(set(red) ^ expected):
                where = "the log only" if node in red else "the list only"
                lines.append(f"- disagreement: {node} ({where})")
        lines.append("")
        if not patched:
            self.not_run.append("the tests with this change (no log)")
            lines.append(
                f"With this change: not run (no `{rel(ev.sources.patched_log)}`)."
            )
        else:
            counts = _summary(patched)
            scope = (
                "on the source with the whole series applied, not on this branch alone"
            )
            lines.append(
                f"With this change ({ev.patched.cite}, {scope}): {counts}."  # type: ignore[union-attr]
            )
            failing = sorted(n for n, o in patched.items() if o != "passed")
            lines += [f"- {patched[n]}: {n}" for n in failing]
        lines += ["", self.sm90(files), "", self.neighbours(), "", self.gpu_suite()]
        return "\n".join(lines)

    def sm90(self, files: list[str]) -> str:
        names = {Path(f).name for f in files}

        def of_mine(outcomes: dict[str, str] | None) -> dict[str, str]:
            return {
                n: o
                for n, o in (outcomes or {}).items()
                if Path(n.split("::")[0]).name in names
            }

        step = self.evidence.gpu_step or {}
        pristine, patched = of_mine(step.get("pristine")), of_mine(step.get("patched"))
        if pristine and patched:
            red = sum(o in ("failed", "error") for o in pristine.values())
            lines = [
                (
                    f"On an SM90 GPU ({self.evidence.gpu_device or 'unnamed'}), "
                    "upstream's glm5next step from `tests/` "
                    f"(`{rel(self.evidence.sources.gpu_results)}`): {red} of "
                    f"{len(pristine)} fail on vLLM {self.version} without this "
                    f"change; with it, {_summary(patched)}."
                )
            ]
            lines += [
                f"- {o} (without this change: {pristine.get(n, 'not run')}): {n}"
                for n, o in sorted(patched.items())
                if o != "passed"
            ]
            return "\n".join(lines) + "\n\n" + self.emulated_sm90().strip()
        mine = of_mine(self.evidence.gpu)
        if not mine:
            self.not_run.append("this change's tests on an SM90 GPU")
            emulated = self.emulated_sm90()
            return (
                "On an SM90 host (upstream's glm5next step runs on an H200): not "
                "run; the runs above are on a CPU-only host." + emulated
            )
        return (
            f"On an SM90 host ({self.evidence.gpu_device or 'H200'}, "
            f"`{rel(self.evidence.sources.gpu_results)}`): {_summary(mine)}."
        )

    def emulated_sm90(self) -> str:
        """The emulated SM90 host's outcomes of this change's tests, or ''."""
        ev = self.evidence
        pristine, patched = self.mine(ev.sm90_pristine), self.mine(ev.sm90_patched)
        log = ev.sources.sm90_patched_log
        if not pristine or not patched or log is None:
            return ""
        red = sum(o == "failed" for o in pristine.values())
        return (
            " On an emulated SM90 host (vLLM's platform answering as one SM90 "
            "GPU for the whole session, a stub CUDA driver; "
            f"`{rel(log)}`): {red} of {len(pristine)} fail "
            f"on vLLM {self.version} without this change; with it, "
            f"{_summary(patched)}."
        )

    def neighbours(self) -> str:
        text = self.evidence.neighbours
        listed = _neighbours_of(self.evidence.sources.neighbours_list, self.patch)
        if not listed:
            return "Neighbouring upstream tests: none declared for this change."
        files = ", ".join(f"`{p}`" for p in listed)
        if text is None:
            self.not_run.append("the neighbouring upstream tests")
            return f"Neighbouring upstream tests ({files}): not run (no log)."
        summary = [
            line.strip()
            for line in text.splitlines()
            if line.startswith(("pristine:", "patched:", "failed in both trees:"))
        ]
        return (
            f"Neighbouring upstream tests ({files}, with the other declared "
            f"files; `{rel(self.evidence.sources.neighbours_log)}`), the same "
            f"outcome for every test on vLLM {self.version} and with the series: "
            + "; ".join(summary)
            + ". Tests failing in both fail on this CPU-only host."
        )

    def gpu_suite(self) -> str:
        gpu = self.evidence.gpu
        if gpu is None:
            self.not_run.append(
                "this project's SM90 kernel tests (`scripts/patchset gpu --collect`)"
            )
            return (
                "This project's SM90 kernel tests: not run (no `junit.xml` in "
                f"`{rel(self.evidence.sources.gpu_results)}`)."
            )
        files = sorted({Path(n.split("::")[0]).name for n in gpu})
        return (
            f"On the H200 ({self.evidence.gpu_device or 'H200'}), this project's "
            f"kernel tests ({', '.join(files)}; not part of this PR): "
            f"{_summary(gpu)}."
        )

    # Details ---------------------------------------------------------
    def details(self) -> str:
        design = [
            u
            for u in self.units[2:]
            if not numbers(u)
            and not u.startswith(("Test", "-"))
            and not u.endswith(":")
        ]
        lines = []
        if design:
            lines += ["### Design and trade-offs", ""]
            for unit in design:
                lines += [unit, ""]
        lines += ["### What changes", "", "| file | change |", "| --- | --- |"]
        for change in file_changes(self.patch):
            kind = "new" if change.new else "changed"
            lines.append(
                f"| `{change.path}` | {kind}, +{change.added}/-{change.removed} |"
            )
        lines += ["", "### Recommended configuration", "", self.configuration()]
        lines += ["", "### Limitations", "", self.limitations()]
        lines += [
            "",
            "### AI assistance",
            "",
            (
                "This change was prepared with AI assistance. The submitter "
                "reviewed every changed line and ran the tests above."
            ),
            "",
            "<details>",
            "<summary>Commit message</summary>",
            "",
            "```text",
            message(self.patch),
            "```",
            "",
            "</details>",
        ]
        return "\n".join(lines)

    def configuration(self) -> str:
        out = []
        for section in self.evidence.readme:
            if not any(
                belongs(section, t.text, t.before, self.patch) for t in section.tables
            ) and not PATCH_REF.findall(section.title):
                continue
            if PATCH_REF.findall(section.title) and not belongs(
                section, "", "", self.patch
            ):
                continue
            out += [f"From {section.cite}:", ""]
            for table in section.tables:
                if all(self.keep(row) for row in table.lines):
                    out += [table.text, ""]
            out += [blocks([p for p in section.paragraphs() if self.keep(p)]), ""]
        for section in self.evidence.measurements:
            if PATCH_REF.findall(section.title) and belongs(
                section, "", "", self.patch
            ):
                for code in section.code:
                    out += [f"From {section.cite}:", "", "```bash", code, "```", ""]
                    break
        return "\n".join(out).strip() or "Nothing beyond the defaults."

    def limitations(self) -> str:
        out = []
        for section in self.evidence.readme:
            if section.title.lower().startswith("limits"):
                out += [p for p in section.paragraphs() if self.keep(p)]
        out += [f"- Not run: {what}." for what in dict.fromkeys(self.not_run)]
        return blocks(out) or "None stated."


def blocks(paragraphs: list[str]) -> str:
    """Paragraphs one per line, a blank line between them except between
    list items (markdown needs it to keep them apart)."""
    out: list[str] = []
    for paragraph in paragraphs:
        if out and not (out[-1].startswith("- ") and paragraph.startswith("- ")):
            out.append("")
        out.append(paragraph)
    return "\n".join(out)


def _label(item: str) -> str:
    """A checklist item's name: its bold lead, else its first clause."""
    bold = re.search(r"\*\*(.+?):?\*\*", item)
    text = bold.group(1) if bold else re.split(r"[.(]", item.strip())[0]
    return text.strip().rstrip(":").replace("`", "")


TREES = ("pristine", "patched")
"""The trees of the engine stage's run (`gpu --engine`): one junit each."""


def _junit(path: Path) -> dict[str, str] | None:
    """The outcomes `path` holds, or None when it is absent or not XML."""
    try:
        return read_outcomes(path) if path.is_file() else None
    except ET.ParseError:
        return None


def _summary(outcomes: dict[str, str]) -> str:
    values = list(outcomes.values())
    return (
        ", ".join(
            f"{values.count(o)} {o}"
            for o in ("passed", "failed", "error", "skipped")
            if values.count(o)
        )
        or "no test"
    )


def _neighbours_of(listing: Path, patch: Patch) -> list[str]:
    """The neighbour files declared for `patch`: those after a comment line
    that names its number (`# 0001 and 0002: ...`)."""
    if not listing.is_file():
        return []
    found, current = [], set()
    for raw in listing.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#"):
            named = set(re.findall(r"(?<![\d.])(\d{4})(?![\d.])", line))
            if named:
                current = named
        elif line and patch_number(patch) in current:
            found.append(line.split()[0])
    return found


def _checklist(template_lines: list[str], writer: Writer) -> list[str]:
    """The template's checklist, each box checked only where true."""
    evidence = writer.evidence
    tested = bool(writer.mine(evidence.pristine)) and bool(
        writer.mine(evidence.patched)
    )
    reasons = {
        "ai assistance": (True, ""),
        "pr-checklist": (False, "vLLM's /pr-checklist skill was not used"),
        "design fit": (False, "a reviewer's judgement, not shown by data here"),
        "testing and validation": (
            tested and not writer.not_run,
            "not everything ran: " + "; ".join(writer.not_run),
        ),
        "code quality": (False, "not shown by data here"),
        "pull request contents": (
            not writer.untraced,
            "some figures of the message have no source",
        ),
    }
    out, unchecked = [], []
    for line in template_lines:
        box = re.match(r"^(\s*- )\[[ xX]\]( .*)$", line)
        if not box:
            out.append(line)
            continue
        key = next((k for k in reasons if k in line.lower()), None)
        checked, why = reasons.get(key, (False, "")) if key else (False, "")
        out.append(f"{box.group(1)}[{'x' if checked else ' '}]{box.group(2)}")
        if not checked and why:
            unchecked.append(f"{_label(box.group(2))} ({why})")
    writer.unchecked = unchecked  # type: ignore[attr-defined]
    return out


def write(
    patch: Patch, evidence: Evidence, branch: Branch, template: str
) -> Description:
    """The description of `patch` exported to `branch`, in `template`'s
    layout: its headings filled, its comments dropped, its checklist kept."""
    writer = Writer(patch, evidence, branch)
    filled = {
        "overview": writer.overview(),
        "claims": writer.claims(),
        "validation": writer.validation(),
    }
    filled["details"] = writer.details()
    lines = template.splitlines()
    out = [f"<!-- title: {patch.subject} -->", ""]
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if line.startswith("<!--") and "-->" in line and not out[-1].startswith("##"):
            out.append(line)
            continue
        out.append(line)
        if not line.startswith("## "):
            continue
        key = next((k for k in filled if k in line.lower()), None)
        while index < len(lines) and (
            not lines[index].strip() or lines[index].lstrip().startswith("<!--")
        ):
            if lines[index].lstrip().startswith("<!--"):
                while index < len(lines) and "-->" not in lines[index]:
                    index += 1
            index += 1
        if key:
            out += ["", filled[key], ""]
    out = _checklist(out, writer)
    text = "\n".join(out).rstrip() + "\n"
    unchecked = getattr(writer, "unchecked", [])
    if unchecked:
        marker = "### AI assistance"
        note = "Checklist boxes left unchecked: " + "; ".join(unchecked) + ".\n\n"
        text = text.replace(marker, note + marker, 1)
    return Description(patch.subject, text, writer.untraced, writer.not_run)


# ------------------------------------------------------------- checking


def headings(template: str) -> list[str]:
    return [line for line in template.splitlines() if line.startswith("## ")]


def check(text: str, template: str, evidence: Evidence) -> list[str]:
    """What is wrong with description `text`: a template heading missing,
    a figure no source holds, a placeholder identity, a hard-wrapped
    paragraph. Empty when it is fine."""
    problems = [
        f"missing the template's heading {h!r}"
        for h in headings(template)
        if h not in text.splitlines()
    ]
    if PLACEHOLDER.search(text):
        problems.append(f"a placeholder identity: {PLACEHOLDER.search(text).group(0)}")  # type: ignore[union-attr]
    prose = _prose(text)
    pool = evidence.pool()
    for figure in dict.fromkeys(numbers(prose)):
        if not is_trivial(figure) and pool.source_of(figure) is None:
            problems.append(f"the figure {figure} is in no measurements table or log")
    for first, second in _wrapped(text):
        problems.append(f"a hard-wrapped paragraph: {first[:50]!r} / {second[:30]!r}")
    return problems


def _prose(text: str) -> str:
    """`text` without what is not a claim: code, the collapsed commit
    message, HTML comments, headings, links, node ids, paths."""
    text = re.sub(
        r"<details>\s*<summary>Commit message</summary>.*?</details>",
        " ",
        text,
        flags=re.S,
    )
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"^#.*$", " ", text, flags=re.M)
    text = re.sub(r"\S+\.(?:py|md|txt|log|xml)\S*", " ", text)
    text = re.sub(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}", " ", text)
    text = re.sub(r"\+\d+/-\d+", " ", text)  # a file's diffstat
    return text


def _wrapped(text: str) -> list[tuple[str, str]]:
    """Consecutive prose lines (one paragraph broken over lines)."""
    found, in_code = [], False
    lines = text.splitlines()
    for first, second in zip(lines, lines[1:]):
        if first.lstrip().startswith("```"):
            in_code = not in_code
        if in_code or second.lstrip().startswith("```"):
            continue
        if (
            first.strip()
            and second.strip()
            and not BLOCK_START.match(first)
            and not BLOCK_START.match(second)
            and not first.startswith(("**", "</", "<"))
        ):
            found.append((first, second))
    return found
