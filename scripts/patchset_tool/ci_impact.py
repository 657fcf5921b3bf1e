# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset ci-impact`: which of the base's Buildkite steps a pull request
with the series would trigger, and which of their tests run here.

A step (and each of its `mirror`s) is triggered when a file the series touches
starts with one of its `source_file_dependencies`; a step without that key runs
for any change. What a step runs is read by upstream's own
`check_test_tethering.py` of that release, so the report runs in the base's
managed environment (PyYAML) through `run_in_env`.
"""

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from . import envmgr, neighbours, paths, runner, upstream
from .bases import Base, get_base
from .errors import PatchsetError
from .series import Series

TETHERING = "tools/pre_commit/check_test_tethering.py"


def run_in_env(base: Base) -> int:
    """The report for `base`, made in its managed environment (set up
    first when needed); the report's exit status."""
    python = envmgr.setup(base)
    env = runner.tree_env(python, base, pristine=True)
    with tempfile.TemporaryDirectory(prefix="patchset-ci-impact-") as tmp:
        clone = upstream.scratch_clone(Path(tmp), base)
        command = [str(python), "-m", "patchset_tool.ci_impact"]
        command += ["--base", base.version, str(clone)]
        return subprocess.run(command, env=env, cwd=paths.REPO).returncode


def load_tethering(checkout: Path) -> ModuleType:
    """Upstream's tethering script of the release in `checkout`."""
    spec = importlib.util.spec_from_file_location(
        "check_test_tethering", checkout / TETHERING
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def steps(checkout: Path, tethering: ModuleType) -> list[dict[str, Any]]:
    """Every step of the release's test areas, mirrors as their own."""
    import yaml

    found = []
    for area in sorted((checkout / ".buildkite" / "test_areas").glob("*.yaml")):
        doc = yaml.safe_load(area.read_text()) or {}
        for step in tethering._iter_job_steps(doc):
            found.append({**step, "area": area.name})
    return found


def triggered_by(step: dict[str, Any], touched: list[str]) -> list[str]:
    """The step's dependencies that a touched file starts with."""
    deps = step.get("source_file_dependencies") or []
    return [d for d in deps if any(f.startswith(d) for f in touched)]


def runs_here(
    step: dict[str, Any], tethering: ModuleType, here: list[str]
) -> list[str]:
    """The files of `here` that the step's commands run."""
    commands = [c for c in step.get("commands") or [] if isinstance(c, str)]
    if isinstance(step.get("command"), str):
        commands.append(step["command"])
    selections = [s for c in commands for s in tethering._parse_command(c)]
    return [f for f in here if tethering.is_tethered(f, selections)]


def files_run_here(series: Series, checkout: Path) -> list[str]:
    """The test files `patchset test` runs for the base of `series` (paths
    in vLLM's tree)."""
    model_tests = sorted(
        p.relative_to(checkout).as_posix()
        for p in (checkout / paths.MODEL_TESTS).glob("test_*.py")
    )
    model_tests += [p for p in series.test_files if Path(p).name.startswith("test_")]
    runnable = [n.path for n in neighbours.load() if not n.skip]
    return sorted(set(model_tests)) + [p for p in runnable if (checkout / p).is_file()]


def report(base: Base, checkout: Path) -> str:
    series = Series.load(base)
    touched = sorted(series.touched)
    tethering = load_tethering(checkout)
    here = files_run_here(series, checkout)
    all_steps = steps(checkout, tethering)
    always = [s for s in all_steps if "source_file_dependencies" not in s]
    rows = []
    for step in all_steps:
        matched = triggered_by(step, touched)
        if matched:
            ran = runs_here(step, tethering, here)
            rows.append((step, matched, ran))
    head = (
        f"vLLM {base.version}: the series touches {len(touched)} files; "
        f"{len(rows)} of {len(all_steps)} Buildkite steps (mirrors counted apart) "
        f"list one of them in source_file_dependencies ({len(always)} list none "
        "and run for any change)."
    )
    lines = [
        head,
        "",
        "| step | device | triggered by | run here |",
        "| --- | --- | --- | --- |",
    ]
    for step, matched, ran in rows:
        label = step.get("label", step.get("key", "?"))
        names = [Path(f).name for f in ran]
        shown = ", ".join(names) if len(names) <= 3 else f"{len(names)} files"
        lines.append(
            f"| {label} ({step['area']}) | {step.get('device', '?')} | "
            f"{', '.join(matched)} | {shown or 'no'} |"
        )
    some = sum(1 for _, _, ran in rows if ran)
    lines += ["", f"{some} of the {len(rows)} triggered steps run a file run here."]
    ran_here = {f for _, _, ran in rows for f in ran}
    lines += [
        f"Run here, but by no triggered step: {f}"
        for f in here
        if f not in ran_here and not f.startswith(f"{paths.MODEL_TESTS}/")
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m patchset_tool.ci_impact")
    parser.add_argument("--base", required=True)
    parser.add_argument("checkout", type=Path, help="the release's source")
    args = parser.parse_args(argv)
    try:
        print(report(get_base(args.base), args.checkout))
    except (PatchsetError, OSError) as exc:
        print(f"patchset: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
