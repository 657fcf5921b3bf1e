# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The command line the coverage and capacity reports share
(patchset_tool.reports.cli): text, one JSON line, or with `--batch FILE` one
JSON line per argument list, measured in the same process (here with
stand-ins for the vLLM measurements; the real reports run in
test_reports_on_vllm.py)."""

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from patchset_tool import paths
from patchset_tool.reports.cli import REPORTS, main, parse_report_args

CALLS: list[str] = []


def stand_in(name: str, default: int) -> SimpleNamespace:
    """A report `name` that reports its `--layers` (default `default`)."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--layers", type=int, default=default)

    def measure(args: argparse.Namespace) -> dict:
        CALLS.append(name)
        return {"report": name, "layers": args.layers}

    def format_report(report: dict, seconds: float) -> str:
        return f"{report['layers']} layers"

    return SimpleNamespace(
        __doc__=f"the {name} report",
        add_arguments=add_arguments,
        measure=measure,
        format_report=format_report,
    )


STAND_INS = {"coverage": stand_in("coverage", 45), "capacity": stand_in("capacity", 1)}


@pytest.fixture(autouse=True)
def calls() -> None:
    CALLS.clear()


def test_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["coverage", "--layers", "3"], STAND_INS) == 0
    assert capsys.readouterr().out == "3 layers\n"
    main(["coverage", "--json"], STAND_INS)
    report = json.loads(capsys.readouterr().out)
    assert report["layers"] == 45 and "seconds" in report


def test_batch_prints_one_json_line_per_case(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A case that names a report is that report's; any other, the named
    report's."""
    cases = tmp_path / "cases.json"
    cases.write_text(
        json.dumps([["--layers", "1"], [], ["capacity"], ["--layers", "46"]])
    )
    main(["coverage", "--batch", str(cases)], STAND_INS)
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["report"], r["layers"]) for r in reports] == [
        ("coverage", 1),
        ("coverage", 45),
        ("capacity", 1),
        ("coverage", 46),
    ]
    assert CALLS == ["coverage", "coverage", "capacity", "coverage"]


@pytest.mark.parametrize(
    "content", ['{"not": "a list"}', '[["--layers", "1"], "--layers"]']
)
def test_batch_that_is_not_a_list_of_lists_is_refused(
    tmp_path: Path, content: str
) -> None:
    cases = tmp_path / "cases.json"
    cases.write_text(content)
    with pytest.raises(SystemExit, match="expected a JSON list of argument lists"):
        main(["coverage", "--batch", str(cases)], STAND_INS)
    assert CALLS == []


def test_batch_takes_no_other_option(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="takes no other option"):
        main(["coverage", "--json", "--batch", str(tmp_path)], STAND_INS)


def test_unknown_report_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["throughput", "--json"], STAND_INS)
    assert "invalid choice: 'throughput'" in capsys.readouterr().err
    assert CALLS == []


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_one_parser_for_every_report(name: str) -> None:
    """The real reports' options parse without vLLM, the tool's own
    options documented beside them."""
    args = parse_report_args([name, "--json", "--pristine"])
    assert (args.report, args.json, args.pristine) == (name, True, True)


def test_runs_as_a_module_without_the_suite_on_sys_path() -> None:
    """`python -m patchset_tool.reports NAME --help` needs neither vLLM nor
    the verification suite's helpers: the reports import those when they
    measure."""
    for name in REPORTS:
        done = subprocess.run(
            [sys.executable, "-m", "patchset_tool.reports", name, "--help"],
            cwd=paths.REPO / "scripts",
            capture_output=True,
            text=True,
            check=True,
        )
        assert done.stdout.startswith(f"usage: patchset {name} ")


def test_options_vllm_refuses_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The checks vLLM makes of the options (an unknown --quantization, a --tp
    the heads do not divide, a long --max-model-len) raise a ValueError."""
    refused = stand_in("coverage", 45)

    def measure(args: argparse.Namespace) -> dict:
        raise ValueError("1 validation error for ModelConfig\n  Value error, no\n")

    refused.measure = measure
    assert main(["coverage"], {"coverage": refused}) == 2
    assert capsys.readouterr().err == (
        "patchset coverage: error: 1 validation error for ModelConfig Value error, no\n"
    )
