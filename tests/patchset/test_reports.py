# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The command line the coverage and capacity reports share: text, one JSON
line, or with `--batch FILE` one JSON line per argument list, measured in
the same process (here with a stand-in for the vLLM measurement; the real
reports run in test_coverage.py and test_capacity.py)."""

import argparse
import json
from pathlib import Path

import pytest

from patchset_tool.reports import run_reports


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=45)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    measure.calls += 1  # type: ignore[attr-defined]
    return {"layers": args.layers}


def text(report: dict, seconds: float) -> str:
    return f"{report['layers']} layers"


@pytest.fixture(autouse=True)
def calls() -> None:
    measure.calls = 0  # type: ignore[attr-defined]


def test_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_reports(["--layers", "3"], parse, measure, text) == 0
    assert capsys.readouterr().out == "3 layers\n"
    run_reports(["--json"], parse, measure, text)
    report = json.loads(capsys.readouterr().out)
    assert report["layers"] == 45 and "seconds" in report


def test_batch_prints_one_json_line_per_case(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([["--layers", "1"], [], ["--layers", "46"]]))
    run_reports(["--batch", str(cases)], parse, measure, text)
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["layers"] for line in lines] == [1, 45, 46]
    assert measure.calls == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "content", ['{"not": "a list"}', '[["--layers", "1"], "--layers"]']
)
def test_batch_that_is_not_a_list_of_lists_is_refused(
    tmp_path: Path, content: str
) -> None:
    cases = tmp_path / "cases.json"
    cases.write_text(content)
    with pytest.raises(SystemExit, match="expected a JSON list of argument lists"):
        run_reports(["--batch", str(cases)], parse, measure, text)
    assert measure.calls == 0  # type: ignore[attr-defined]


def test_batch_takes_no_other_option(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="takes no other option"):
        run_reports(["--json", "--batch", str(tmp_path)], parse, measure, text)
