# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tool's modules by floor, read from their imports.

A module on floor 0 imports no other module of `patchset_tool`; a module on
floor N imports at least one on floor N-1 and none above. Every `import`
statement counts, including those inside functions; a module loaded by name
at run time (`importlib`) does not.

    python3 tests/patchset/module_floors.py         # the README's picture
    python3 tests/patchset/module_floors.py --all   # every module's imports

`test_readme.py` checks that README.md holds exactly this picture.
"""

import ast
import sys
import textwrap
from pathlib import Path

PACKAGE = "patchset_tool"
TOOL = Path(__file__).resolve().parents[2] / "scripts" / PACKAGE


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The sibling modules that the module at `path` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:
                names = [alias.name for alias in node.names]
            elif node.level == 1 and node.module:
                names = [node.module.split(".")[0]]
            elif node.level == 0 and (node.module or "").startswith(PACKAGE + "."):
                names = [node.module.split(".")[1]]  # type: ignore[union-attr]
            elif node.level == 0 and node.module == PACKAGE:
                names = [alias.name for alias in node.names]
            else:
                names = []
        elif isinstance(node, ast.Import):
            names = [
                alias.name.split(".")[1]
                for alias in node.names
                if alias.name.startswith(PACKAGE + ".")
            ]
        else:
            continue
        found.update(name for name in names if name in modules)
    found.discard(path.stem)
    return found


def import_graph(tool: Path = TOOL) -> dict[str, set[str]]:
    """Each module of the package (but `__init__`) and the siblings it imports."""
    files = {p.stem: p for p in sorted(tool.glob("*.py")) if p.stem != "__init__"}
    return {name: imports_of(path, set(files)) for name, path in files.items()}


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor; raises ValueError on an import cycle."""
    floor: dict[str, int] = {}
    visiting: set[str] = set()

    def visit(name: str) -> int:
        if name in floor:
            return floor[name]
        if name in visiting:
            raise ValueError(f"import cycle through {name}")
        visiting.add(name)
        floor[name] = 1 + max((visit(dep) for dep in graph[name]), default=-1)
        visiting.discard(name)
        return floor[name]

    for name in graph:
        visit(name)
    return floor


def render(graph: dict[str, set[str]]) -> str:
    """The picture: one line per floor, top floor first; each module with
    the modules of the floor right below that it imports (which put it on
    its floor)."""
    floor = floors(graph)
    lines = []
    for level in range(max(floor.values()), -1, -1):
        shown = []
        for name in sorted(n for n in graph if floor[n] == level):
            below = sorted(d for d in graph[name] if floor[d] == level - 1)
            shown.append(name + (f" ({' '.join(below)})" if below else ""))
        head = f"{level}  "
        wrapped = textwrap.wrap(", ".join(shown), 79 - len(head))
        lines.append(head + wrapped[0])
        lines += [" " * len(head) + more for more in wrapped[1:]]
    return "\n".join(lines) + "\n"


def render_all(graph: dict[str, set[str]]) -> str:
    """Every module with every sibling it imports, top floor first."""
    floor = floors(graph)
    rows = []
    for name in sorted(graph, key=lambda n: (-floor[n], n)):
        rows.append(f"{floor[name]}  {name}: {' '.join(sorted(graph[name])) or '-'}")
    return "\n".join(rows) + "\n"


def main() -> int:
    try:
        graph = import_graph()
        sys.stdout.write(render_all(graph) if "--all" in sys.argv else render(graph))
    except ValueError as exc:
        print(f"module_floors: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
