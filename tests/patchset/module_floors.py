# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tool's modules by floor, read from their imports.

A module on floor 0 imports no other module of `patchset_tool`; a module on
floor N imports at least one on floor N-1 and none above. A subpackage
(`commands`, `reports`) counts as one module: its files' imports together,
its `__init__` included, imports among its own files left out.
Every `import` statement counts, including those inside functions; a module
loaded by name at run time (`importlib`) does not.

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


def module_name(path: Path, tool: Path = TOOL) -> str:
    """The name of the picture's module that the file at `path` belongs
    to: its own stem at the top (`runner`), else its subpackage
    (`reports/cli.py` is `reports`)."""
    return path.relative_to(tool).with_suffix("").parts[0]


def resolve(name: str, modules: set[str]) -> str | None:
    """The module of the package that dotted `name` (inside the package)
    is or lies in: `reports.cli.main` is `reports`."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def imports_of(path: Path, modules: set[str], tool: Path = TOOL) -> set[str]:
    """The modules of the package that the file at `path` imports."""
    own = module_name(path, tool)
    package = list(path.relative_to(tool).parts[:-1])  # its subpackage, if any
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                above = package[: len(package) - node.level + 1]
                base = ".".join([*above, *(node.module or "").split(".")])
            elif node.module == PACKAGE or (node.module or "").startswith(
                PACKAGE + "."
            ):
                base = node.module.removeprefix(PACKAGE)  # type: ignore[union-attr]
            else:
                continue
            base = base.strip(".")
            for alias in node.names:
                found.add(resolve(f"{base}.{alias.name}".strip("."), modules))
        elif isinstance(node, ast.Import):
            found.update(
                resolve(alias.name.removeprefix(PACKAGE + "."), modules)
                for alias in node.names
                if alias.name.startswith(PACKAGE + ".")
            )
    found.discard(own)
    return {name for name in found if name is not None}


def import_graph(tool: Path = TOOL) -> dict[str, set[str]]:
    """Each module of the package (a subpackage being one) and the modules
    of the package it imports."""
    files = [
        p
        for p in sorted(tool.rglob("*.py"))
        if p.parent != tool or p.stem != "__init__"
        if "__pycache__" not in p.parts
    ]
    modules = {module_name(p, tool) for p in files}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for path in files:
        graph[module_name(path, tool)] |= imports_of(path, modules, tool)
    return graph


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
    width = len(str(max(floor.values())))
    for level in range(max(floor.values()), -1, -1):
        shown = []
        for name in sorted(n for n in graph if floor[n] == level):
            below = sorted(d for d in graph[name] if floor[d] == level - 1)
            shown.append(name + (f" ({' '.join(below)})" if below else ""))
        head = f"{level:>{width}}  "
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
