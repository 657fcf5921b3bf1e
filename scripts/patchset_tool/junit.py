# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""pytest's junit XML (xunit1) and the node-id lists the tests are held to."""

import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


def read_outcomes(xml: Path) -> dict[str, str]:
    """Each test's node id (`path/to/test_x.py::name`) to one of OUTCOMES.

    Raises FileNotFoundError when there is no file, ET.ParseError when it is
    not XML, ValueError when a case has no name or comes twice.
    """
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        node = f"{module}.py::{case.get('name')}"
        if not module or not case.get("name") or node in outcomes:
            raise ValueError(f"a test case without a name, or twice: {node}")
        tags = {child.tag for child in case}
        outcomes[node] = next(
            (o for o in ("failure", "error", "skipped") if o in tags), "passed"
        ).replace("failure", "failed")
    return outcomes


def read_node_list(path: Path) -> set[str]:
    """The node ids listed in `path`, one per line; # starts a comment; an
    absent file lists none."""
    if not path.is_file():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}
