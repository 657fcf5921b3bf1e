# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`export --check`: what is wrong with a hand-written pull-request
description (`docs/pr/NNNN.md`) before a vLLM reviewer reads it.

- a heading of vLLM's pull-request template is missing;
- it is too long: `WORDS_OPEN` words outside collapsed `<details>`,
  `WORDS_ALL` in all;
- a figure in its prose appears nowhere in `docs/measurements.md`;
- it names a path vLLM does not have (this repository's own, such as
  `scripts/patchset` or `build/test-logs/`);
- it names a test as run (`file.py::test`) that no recorded log shows
  with an outcome (`build/test-logs/`, the GPU results under `build/gpu/`),
  or with an outcome (`PASSED`, `FAILED`, ...) no log gives it;
- it carries the project's placeholder identity.
"""

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

HEADINGS = (
    "## Overview",
    "## Claims",
    "## Validation",
    "## Details",
    "Pull Request Checklist",
)
"""vLLM's .github/PULL_REQUEST_TEMPLATE.md (0.33.0, 0.34.0)."""
WORDS_OPEN, WORDS_ALL = 700, 1200
PLACEHOLDER = re.compile(r"@[\w.-]*\.example\b|\bSeed [0-9a-f]{8} maintainers\b")
FIGURE = re.compile(
    r"(?<![\w.#/@:])(\d[\d,]*(?:\.\d+)?)(?:x|%|[KMG]i?B|[mµu]?s|[KMB])?(?![\w]|[.,]\d)"
)
"""A number (with its unit) not inside a word, an issue number or a path."""
PATH = re.compile(
    r"(?<![\w./:-])((?:\.?[\w-]+/)+(?:[\w.-]+)?)"  # a/b, a/b/, a/b.ext
    r"|(?<![\w./:-])([\w-]+\.(?:py|md|toml|txt|log|xml|yaml|sh))\b"
)
NODE = re.compile(r"([\w/.-]+\.py)::([\w\[\]./,=-]+)")
WORD = r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
RAN = re.compile(rf"{WORD} {NODE.pattern}|{NODE.pattern} {WORD}\b")
"""A test with its outcome, as pytest's `-v` and `-rA` lines give it."""
JUNIT_CASE = re.compile(
    r'<testcase classname="([\w.]+)" name="([^"]+)"[^>]*?(/>|>.*?</testcase>)', re.S
)


@dataclass
class Records:
    """What a description may cite: the measurements' text, the recorded
    test ids (`file.py::name`, by file name), and whether a path is vLLM's."""

    measurements: str
    tests: dict[str, set[str]]
    """Each test a log shows run, with the outcomes the logs give it."""
    in_vllm: Callable[[str], bool]

    @classmethod
    def read(
        cls, measurements: Path, logs: list[Path], in_vllm: Callable[[str], bool]
    ) -> "Records":
        found = measurements.is_file()
        text = measurements.read_text(encoding="utf-8") if found else ""
        tests: dict[str, set[str]] = {}
        for log in logs:
            data = log.read_text(encoding="utf-8", errors="replace")
            for file, name, outcome in ran(data):
                tests.setdefault(test_key(file, name), set()).add(outcome)
            for module, name, body in JUNIT_CASE.findall(data):
                tag = re.search(r"<(failure|error|skipped)\b", body)
                outcome = {"failure": "FAILED", "error": "ERROR"}.get(
                    tag.group(1) if tag else "", "SKIPPED" if tag else "PASSED"
                )
                key = test_key(module.rsplit(".", 1)[-1] + ".py", name)
                tests.setdefault(key, set()).add(outcome)
        return cls(text, tests, in_vllm)


def ran(text: str) -> Iterator[tuple[str, str, str]]:
    """(file, test, outcome) of each test `text` gives an outcome."""
    for before, file, name, file2, name2, after in RAN.findall(text):
        yield (file, name, before) if before else (file2, name2, after)


def test_key(file: str, name: str) -> str:
    return f"{Path(file).name}::{name}"


def _without(text: str, *patterns: str) -> str:
    for pattern in patterns:
        text = re.sub(pattern, " ", text, flags=re.S)
    return text


def words(text: str) -> tuple[int, int]:
    """Words outside collapsed `<details>`, and in all (comments left out)."""
    text = _without(text, r"<!--.*?-->")
    open_text = _without(text, r"<details>.*?</details>")
    return len(open_text.split()), len(text.split())


def figures(text: str) -> list[str]:
    """The figures of the prose: code, links and dates left out; a plain
    integer below 100 (a count of tests or layers) needs no source."""
    prose = _without(
        text, r"```.*?```", r"`[^`\n]*`", r"<!--.*?-->", r"https?://\S+", r"\]\([^)]*\)"
    )
    prose = _without(prose, r"\b\d+(?:\.\d+){2,}\b", r"\b\d{4}-\d\d-\d\d\b")
    found = [m.group(1).rstrip(",") for m in FIGURE.finditer(prose)]
    return [f for f in found if "." in f or "," in f or int(f) >= 100]


def in_measurements(figure: str, text: str) -> bool:
    pattern = rf"(?<![\d.,]){re.escape(figure)}(?![\d]|[.,]\d)"
    return re.search(pattern, text) is not None


def paths_named(text: str) -> list[str]:
    """Paths in `text`, URLs left out; a pytest id counts as its file."""
    text = _without(text, r"https?://\S+", r"<!--.*?-->")
    found = []
    for match in PATH.finditer(text):
        path = (match.group(1) or match.group(2)).rstrip(".,")
        # a/b in prose (H100/H200, TP/DCP) is not a path unless it is code,
        # ends in a folder's slash or names a file
        code = text[match.start() - 1 : match.start()] == "`"
        if code or path.endswith("/") or "." in path.rsplit("/", 1)[-1]:
            found.append(path)
    return list(dict.fromkeys(found))


def check(text: str, records: Records) -> list[str]:
    """What is wrong with description `text`; empty when it is fine."""
    lines = [line.strip() for line in text.splitlines()]
    problems = [
        f"missing the template's heading {h!r}"
        for h in HEADINGS
        if not any(line == h or (h[0] != "#" and h in line) for line in lines)
    ]
    open_words, all_words = words(text)
    if open_words > WORDS_OPEN:
        problems.append(
            f"{open_words} words outside collapsed <details> (at most {WORDS_OPEN})"
        )
    if all_words > WORDS_ALL:
        problems.append(f"{all_words} words in all (at most {WORDS_ALL})")
    for figure in dict.fromkeys(figures(text)):
        if not in_measurements(figure, records.measurements):
            problems.append(f"the figure {figure} is not in docs/measurements.md")
    for path in paths_named(text):
        if not records.in_vllm(path.split("::")[0]):
            problems.append(f"names {path}, which vLLM does not have")
    said = {(file, name): outcome for file, name, outcome in ran(text)}
    for file, name in dict.fromkeys(NODE.findall(text)):
        logged = records.tests.get(test_key(file, name), set())
        claim = said.get((file, name))
        if not logged:
            problems.append(f"says {file}::{name} ran; no recorded log shows it")
        elif claim and claim not in logged:
            problems.append(
                f"says {file}::{name} {claim}; the recorded logs give "
                + ", ".join(sorted(logged))
            )
    if found := PLACEHOLDER.search(text):
        problems.append(f"a placeholder identity: {found.group(0)}")
    return problems
