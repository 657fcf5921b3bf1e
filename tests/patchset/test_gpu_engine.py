# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`gpu --engine`: SM90 pruning, parts, the device script, and collecting.

The unit tests here are fast and run everywhere. The end-to-end proof
(`test_stage_builds_fits_and_imports_on_the_device_stack`) builds the whole
stage from the primary base's environment (minutes the first time: it
compresses ~300 MB of extensions and downloads the wheels) and imports vLLM
from it in a Python 3.12 venv holding only the GPU machine's packages; it
runs only when GLM5NEXT_ENGINE_PYTHON names that venv's python.
"""

import io
import json
import lzma
import os
import struct
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from patchset_tool import gpu, gpu_device, gpu_engine
from patchset_tool.errors import PatchsetError

ENTRY_HEADER = 64


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bytearray(ENTRY_HEADER)
    struct.pack_into("<HHIQ", header, 0, kind, 0x0101, ENTRY_HEADER, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", gpu.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(section: bytes) -> bytes:
    """A minimal ELF64 whose only named sections are `.nv_fatbin` and the
    section-name table."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fat_at = 64
    names_at = fat_at + len(section)
    shoff = (names_at + len(names) + 7) & ~7
    head = bytearray(64)
    head[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<HHH", head, 0x3A, 64, 3, 2)
    body = bytes(head) + section + names
    body += bytes(shoff - len(body))

    def shdr(name: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 8, 0)

    return (
        body
        + shdr(0, 0, 0)
        + shdr(1, fat_at, len(section))
        + shdr(11, names_at, len(names))
    )


def kept(library: bytes) -> list[list[tuple[int, int, bytes]]]:
    """(kind, arch, payload) of each fat binary's entries in `library`."""
    section = gpu._fatbin_section(library)
    assert section is not None
    at, end = section[0], section[0] + section[1]
    found = []
    while at + 16 <= end:
        magic, _, header, size = struct.unpack_from("<IHHQ", library, at)
        if magic != gpu.FATBIN_MAGIC:
            at = (at + 8) & ~7
            continue
        cursor, stop, entries = at + header, at + header + size, []
        while cursor < stop:
            kind, _, eh, es = struct.unpack_from("<HHIQ", library, cursor)
            (arch,) = struct.unpack_from("<I", library, cursor + 28)
            entries.append((kind, arch, library[cursor + eh : cursor + eh + es]))
            cursor += eh + es
        found.append(entries)
        at = stop
    return found


def test_sm90_only_keeps_sm90_cubins_and_zeroes_the_rest() -> None:
    first = fatbin(
        entry(2, 80, b"A" * 40),
        entry(2, 90, b"sm90" * 4),
        entry(1, 90, b"ptx90" * 8),
        entry(2, 100, b"B" * 80),
    )
    ptx_only = fatbin(entry(1, 80, b"p80" * 4), entry(1, 89, b"p89" * 4))
    blackwell = fatbin(entry(2, 100, b"C" * 64), entry(2, 120, b"D" * 8))
    section = first + bytes(-len(first) % 8) + ptx_only
    section += bytes(-len(section) % 8) + blackwell
    library = elf(section)
    pruned = gpu.sm90_only(library)
    assert len(pruned) == len(library)
    assert kept(pruned) == [
        [(2, 90, b"sm90" * 4)],
        [(1, 89, b"p89" * 4)],
        [(2, 120, b"D" * 8)],
    ]
    assert b"B" * 80 not in pruned and b"A" * 40 not in pruned
    assert pruned[:64] == library[:64], "the ELF header is untouched"


def test_sm90_only_leaves_a_library_without_device_code_alone() -> None:
    names = b"\0.text\0.shstrtab\0"
    library = elf(b"")
    library = library.replace(b"\0.nv_fatbin\0.shstrtab\0", names.ljust(22, b"\0"))
    assert gpu.sm90_only(library) == library
    with pytest.raises(ValueError):
        gpu.sm90_only(b"not an elf at all" * 8)


def test_parts_fit_the_budget_largest_first(tmp_path: Path) -> None:
    items = []
    for name, size in (("a", 50), ("b", 30), ("c", 30), ("d", 15)):
        (tmp_path / name).write_bytes(bytes(size))
        items.append(tmp_path / name)
    parts = gpu_engine.pack_parts(items, tmp_path / "stage", budget=65)
    names = {
        p: sorted(f.name for f in (tmp_path / "stage" / p).iterdir()) for p in parts
    }
    assert names == {"part1": ["a", "d"], "part2": ["b", "c"]}
    with pytest.raises(PatchsetError, match="no call takes more"):
        gpu_engine.pack_parts(items, tmp_path / "again", budget=40)


def test_an_item_over_the_budget_travels_in_pieces_joined_on_unpack(
    tmp_path: Path,
) -> None:
    wheel = tmp_path / "work" / "big-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    data = bytes(range(256)) * 3
    wheel.write_bytes(data)
    pieces = gpu_engine.split(wheel, budget=300)
    assert [p.name for p in pieces] == [
        f"big-1.0-py3-none-any.whl.{i}-of-3.split" for i in (1, 2, 3)
    ]
    parts = gpu_engine.pack_parts(pieces, tmp_path / "stage", budget=300)
    root = tmp_path / "root"
    for part in parts:
        assert not (root / "wheels").exists(), "nothing installed from a piece"
        gpu_device.unpack(tmp_path / "stage" / part, root)
    assert (root / "wheels" / wheel.name).read_bytes() == data


def tar_xz(path: Path, files: dict[str, bytes]) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(lzma.compress(raw.getvalue()))


def test_device_script_unpacks_parts_and_builds_both_trees(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    for part in ("part1", "part2"):
        (stage / part).mkdir(parents=True)
        manifest = {"parts": ["part1", "part2"]}
        (stage / part / "MANIFEST.json").write_text(json.dumps(manifest))
    (stage / "part1" / "ext-vllm+_C.abi3.so.xz").write_bytes(lzma.compress(b"so"))
    tar_xz(
        stage / "part2" / "vllm-py.tar.xz",
        {"vllm/__init__.py": b"# pristine\n", "vllm/model.py": b"OLD = 1\n"},
    )
    tar_xz(stage / "part2" / "vllm-patched.tar.xz", {"vllm/model.py": b"NEW = 1\n"})
    root = tmp_path / "root"
    gpu_device.unpack(stage / "part2", root)
    with pytest.raises(SystemExit):
        gpu_device.prepare(stage / "part2", root)  # part1 missing: refused
    gpu_device.unpack(stage / "part1", root)
    gpu_device.prepare(stage / "part2", root)
    assert (root / "tree-pristine/vllm/model.py").read_text() == "OLD = 1\n"
    assert (root / "tree-patched/vllm/model.py").read_text() == "NEW = 1\n"
    for tree in gpu_device.TREES:
        assert (root / f"tree-{tree}/vllm/_C.abi3.so").read_bytes() == b"so"


def engine_stage(stage: Path, series: str, patched: bytes) -> Path:
    """A two-part engine stage of `series` whose patched model.py is `patched`."""
    manifest = json.dumps(
        {"vllm": "0.34.0", "series": series, "parts": ["part1", "part2"]}
    )
    for part in ("part1", "part2"):
        (stage / part).mkdir(parents=True)
        (stage / part / "MANIFEST.json").write_text(manifest)
    (stage / "part1" / "ext-vllm+_C.abi3.so.xz").write_bytes(lzma.compress(b"so"))
    tar_xz(stage / "part2" / "vllm-py.tar.xz", {"vllm/model.py": b"OLD = 1\n"})
    tar_xz(stage / "part2" / "vllm-patched.tar.xz", {"vllm/model.py": patched})
    return stage


def test_a_second_stage_on_a_warm_machine_never_runs_on_the_first_ones_trees(
    tmp_path: Path,
) -> None:
    first = engine_stage(tmp_path / "a", "aaaa", b"NEW = 1\n")
    second = engine_stage(tmp_path / "b", "bbbb", b"NEW = 2\n")
    root = tmp_path / "root"
    for part in ("part1", "part2"):
        gpu_device.unpack(first / part, root)
    gpu_device.prepare(first / "part2", root)
    gpu_device.unpack(second / "part2", root)
    with pytest.raises(SystemExit):
        gpu_device.prepare(second / "part2", root)  # its part1 never unpacked
    gpu_device.unpack(second / "part1", root)
    gpu_device.prepare(second / "part2", root)
    assert (root / "tree-patched/vllm/model.py").read_text() == "NEW = 2\n"


def junit(path: Path, cases: dict[str, str]) -> Path:
    rows = []
    for node, outcome in cases.items():
        module, name = node.split("::")
        classname = module.removesuffix(".py").replace("/", ".")
        inner = {"passed": "", "failed": "<failure/>", "skipped": "<skipped/>"}
        case = f'<testcase classname="{classname}" name="{name}">'
        rows.append(f"{case}{inner[outcome]}</testcase>")
    path.write_text(f"<testsuites><testsuite>{''.join(rows)}</testsuite></testsuites>")
    return path


FIX = "tests/models/glm5next/test_fp8_kv_cache.py::test_fix"
UP = "tests/models/glm5next/test_kda_recurrent.py::test_up"


def test_collect_compares_trees_and_replaces_the_results_whole(tmp_path: Path) -> None:
    run = tmp_path / "out"
    run.mkdir()
    (run / "device.txt").write_text("NVIDIA H100 80GB HBM3, 550.54\n")
    junit(run / "junit-pristine.xml", {FIX: "failed", UP: "passed"})
    junit(run / "junit-patched.xml", {FIX: "passed", UP: "passed"})
    dest = tmp_path / "results"
    dest.mkdir()
    (dest / "junit.xml").write_text("<old run/>")
    report = gpu.collect(run, dest, {FIX})
    assert "departures" not in report and "1 passed, 1 failed" in report
    assert "as the run recorded it: NVIDIA H100 80GB HBM3" in report
    assert not (dest / "junit.xml").exists(), "no file of the previous run stays"
    junit(run / "junit-patched.xml", {FIX: "passed", UP: "failed"})
    report = gpu.collect(run, dest, {FIX})
    assert f"{UP}: passed pristine, failed patched" in report


def test_collect_claims_only_the_fixes_the_run_holds(tmp_path: Path) -> None:
    run = a_run(tmp_path, "out")
    lacking = "tests/config/test_draft_kv_cache_dtype.py::test_drafter"
    report = gpu.collect(run, tmp_path / "results", {FIX, lacking})
    assert "departures" not in report
    assert "the 1 claimed fix(es) the run holds" in report
    assert (
        f"claimed fixes the run lacks (1; it vouches for none of them):\n  {lacking}"
        in report
    )


@pytest.mark.parametrize("folder", [".previous", ".incoming"])
def test_collect_refuses_its_own_scratch_folders(tmp_path: Path, folder: str) -> None:
    dest = tmp_path / "results"
    own = a_run(tmp_path, "results" + folder)
    with pytest.raises(PatchsetError, match="overlaps"):
        gpu.collect(own, dest)
    assert (own / "device.txt").is_file(), "left as it was"


def test_collect_refuses_an_empty_run_and_its_own_folder(tmp_path: Path) -> None:
    dest = tmp_path / "results"
    dest.mkdir()
    (dest / "junit.xml").write_text("<kept/>")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "device.txt").write_text("H100\n")
    with pytest.raises(PatchsetError, match="produced no results"):
        gpu.collect(empty, dest)
    (empty / "junit-patched.xml").write_text("<testsuites><testsu")
    with pytest.raises(PatchsetError, match="not readable"):
        gpu.collect(empty, dest)
    with pytest.raises(PatchsetError, match="overlaps"):
        gpu.collect(dest, dest)
    assert (dest / "junit.xml").read_text() == "<kept/>", "left as it was"


ENGINE_PYTHON = os.environ.get("GLM5NEXT_ENGINE_PYTHON")

PROBE = """
import os, sys
from pathlib import Path
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
src, suite, tmp = sys.argv[1:4]
sys.path[:0] = [src, suite]
import vllm
import vllm.entrypoints.llm, vllm.v1.engine.llm_engine
import tests.conftest  # upstream's conftest and all it imports
import tests.utils  # what its dist_init fixture imports
import glm5next_verify as v
config = v.create_vllm_config(v.write_model_dir(Path(tmp) / "model"))
print("OK", vllm.__version__, config.model_config.architecture)
"""


@pytest.mark.skipif(
    not ENGINE_PYTHON,
    reason="set GLM5NEXT_ENGINE_PYTHON to a Python 3.12 venv with the GPU "
    "machine's packages (torch 2.11, triton 3.6, transformers 5.17) to build "
    "the engine stage and import vLLM from it",
)
def test_stage_builds_fits_and_imports_on_the_device_stack(tmp_path: Path) -> None:
    from patchset_tool import bases, paths
    from patchset_tool.series import Series

    series = Series.load(bases.get_base(None))
    dest = paths.build_dir() / "gpu" / f"engine-{series.base.version}"
    manifest = gpu_engine.build(series, dest)
    budget = gpu.CARRY_LIMIT - gpu_engine.PART_MARGIN
    for part in manifest["parts"]:
        size = sum(f.stat().st_size for f in (dest / part).iterdir())
        assert size < budget, f"{part} is {size} bytes"
    assert ENGINE_PYTHON is not None  # the test is skipped without it
    root = tmp_path / "engine"
    env = dict(os.environ, GLM5ENGINE_ROOT=str(root))
    for part in manifest["parts"]:
        subprocess.run(
            [ENGINE_PYTHON, str(dest / part / "engine.py"), "unpack"],
            env=env,
            check=True,
        )
    for tree in gpu_device.TREES:
        done = subprocess.run(
            [ENGINE_PYTHON, str(dest / manifest["parts"][-1] / "engine.py"), "run",
             tree, "--", ENGINE_PYTHON, "-c", PROBE, str(root / "src"),
             str(paths.SUITE), str(tmp_path / tree)],
            env=env, capture_output=True, text=True, cwd=root / "src",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert "OK 0.34.0" in done.stdout


def a_run(tmp_path: Path, name: str) -> Path:
    run = tmp_path / name
    run.mkdir()
    (run / "device.txt").write_text("NVIDIA H200, 550.54\n")
    junit(run / "junit-pristine.xml", {FIX: "failed", UP: "passed"})
    junit(run / "junit-patched.xml", {FIX: "passed", UP: "passed"})
    return run


@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda run: (run / "junit-pristine.xml").unlink(), "one tree alone"),
        (lambda run: (run / "device.txt").unlink(), "not its run"),
        (
            lambda run: (run / "junit-patched.xml").write_text(
                '<testsuite><testcase classname="tests.t" name="a"/>'
                '<testcase classname="tests.t" name="a"/></testsuite>'
            ),
            "twice",
        ),
        (
            lambda run: (run / "junit-patched.xml").write_text(
                '<testsuite><testcase classname="tests.t"/></testsuite>'
            ),
            "without a name",
        ),
        (
            lambda run: (run / "bench.log").symlink_to("/etc/hostname"),
            "symbolic links",
        ),
    ],
    ids=["one-tree", "not-ours", "duplicate-case", "nameless-case", "symlink-out"],
)
def test_collect_refuses_a_run_it_cannot_judge(
    tmp_path: Path, spoil: Callable[[Path], object], words: str
) -> None:
    run = a_run(tmp_path, "out")
    spoil(run)
    dest = tmp_path / "results"
    with pytest.raises(PatchsetError, match=words):
        gpu.collect(run, dest)
    assert not dest.exists()
