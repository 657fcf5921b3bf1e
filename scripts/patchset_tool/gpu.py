# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tests (and the decode benchmark) on a machine that has no vLLM.

The series' SM90 tests drive vLLM's compiled kernels through a few of its
Python files, so a GPU machine with PyTorch but no vLLM runs them from a
*stage*: those files copied out of an installed vLLM (the extensions stripped
and xz-compressed), a stub `vllm/__init__.py`, the tests and a `pytest.ini`.
`stage` writes one, `device_command` runs it there, `collect` summarises what
came back.
"""

import json
import lzma
import re
import shlex
import shutil
import struct
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from .digests import file_sha256
from .errors import PatchsetError
from .junit import OUTCOMES, read_outcomes

CARRY_LIMIT = 64 * 1024 * 1024
"""What may travel to the GPU machine in one call, the working tree included."""


EXTENSIONS = ("_C_stable_libtorch.abi3.so", "_flashmla_C.abi3.so")
"""vLLM's compiled extensions the tests use: the cache ops and FlashMLA."""

PYTHON_FILES = (
    "third_party/__init__.py",
    "third_party/flashmla/__init__.py",
    "third_party/flashmla/flash_mla_interface.py",
    # read (not imported) by the tests for vLLM's own padding rules
    "v1/attention/backends/mla/flashmla_sparse.py",
    "utils/math_utils.py",
    "models/glm5next/common/model.py",
)
"""vLLM's Python files the tests need, relative to the `vllm` package."""

STUB_INIT = '''\
"""Stub: lets vllm's compiled extensions load without importing vLLM."""

__version__ = {version!r}
'''

XZ_PRESET = 9 | lzma.PRESET_EXTREME

BENCH_SCRIPT = "bench_glm5_mla_kv_cache.py"

QUANT_BENCH_SCRIPT = "bench_glm5_online_quant_linear.py"
"""The online-quantization benchmark: it reads `QUANT_PYTHON_FILES` (vLLM's
weight-side quantization functions) through `from_vllm_source` of
`BENCH_SCRIPT`, which travels beside it, with the model's config.json."""

QUANT_PYTHON_FILES = (
    "scalar_type.py",
    "utils/deep_gemm.py",
    "model_executor/layers/quantization/online/fp8.py",
    "model_executor/layers/quantization/utils/quant_utils.py",
    "model_executor/layers/quantization/utils/mxfp8_utils.py",
    "model_executor/layers/quantization/utils/marlin_utils.py",
    "model_executor/layers/quantization/utils/marlin_utils_fp8.py",
)
"""vLLM's Python files the online-quantization benchmark reads, beside
`PYTHON_FILES` (only `scalar_type.py` is imported; the rest is parsed)."""

OUT_FILES = ("junit.xml", "pytest.log", "bench.log", "bench.json", "device.txt")
"""What `device_command` writes into `$OUT` (the bench files with `bench`)."""


def vllm_version(site_packages: Path) -> str:
    """The version of the vLLM installed in `site_packages`.

    Raises FileNotFoundError when there is no `vllm/_version.py`, ValueError
    when it names no version.
    """
    text = (site_packages / "vllm" / "_version.py").read_text()
    match = re.search(r"^__version__ = version = ['\"]([^'\"]+)['\"]", text, re.M)
    if not match:
        raise ValueError(f"no version in {site_packages / 'vllm' / '_version.py'}")
    return match.group(1)


def without_static_symbols(src: Path, work_dir: Path) -> Path:
    """A copy of the shared library `src` in `work_dir` without its static
    symbol table (`strip --strip-unneeded`: its code and the dynamic symbols
    that loading it needs stay), or `src` itself where `strip` is missing.

    vLLM ships its extensions unstripped; 0.33.0's `_C_stable_libtorch`
    (92.6 MB, 79.3 MB stripped) does not fit the GPU machine otherwise."""
    strip = shutil.which("strip")
    if strip is None:
        return src
    copy = work_dir / src.name
    shutil.copyfile(src, copy)
    subprocess.run([strip, "--strip-unneeded", str(copy)], check=True)
    return copy


def xz_cached(src: Path, cache_dir: Path) -> Path:
    """`src` xz-compressed (preset 9e), made once per content.

    The result lives in `cache_dir` as `<sha256 of src>.xz`; it is written to
    a temporary name first, so an interrupted run leaves no partial entry.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"{file_sha256(src)}.xz"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(lzma.compress(src.read_bytes(), preset=XZ_PRESET))
        tmp.replace(out)
    return out


def stage(
    site_packages: Path,
    tests: list[Path],
    dest: Path,
    *,
    cache_dir: Path,
    bench: Path | None = None,
    archives: tuple[Path, ...] = (),
    beside: int = 0,
    bench_files: tuple[Path, ...] = (),
    python_files: tuple[str, ...] = PYTHON_FILES,
) -> Path:
    """Write into `dest` (emptied first) what the GPU machine needs to run `tests`
    from the vLLM installed in `site_packages`, plus `bench` and its `bench_files`,
    the `archives` and `MANIFEST.json`; compressed extensions come from
    `cache_dir`. Returns `dest`. Raises FileNotFoundError for a missing input and
    ValueError when the stage and the `beside` bytes of working tree that travel
    with it exceed `CARRY_LIMIT`.
    """
    pkg = site_packages / "vllm"
    version = vllm_version(site_packages)
    sources = [pkg / name for name in EXTENSIONS]
    sources += [pkg / rel for rel in python_files]
    sources += [*tests, *([bench, *bench_files] if bench else []), *archives]
    for src in sources:
        if not src.is_file():
            raise FileNotFoundError(src)

    if dest.exists():
        shutil.rmtree(dest)
    (dest / "vllm").mkdir(parents=True)
    (dest / "vllm" / "__init__.py").write_text(STUB_INIT.format(version=version))
    with tempfile.TemporaryDirectory(prefix="patchset-gpu-") as tmp:
        for name in EXTENSIONS:
            library = without_static_symbols(pkg / name, Path(tmp))
            packed = xz_cached(library, cache_dir)
            shutil.copyfile(packed, dest / "vllm" / f"{name}.xz")
    for rel in python_files:
        (dest / "vllm" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pkg / rel, dest / "vllm" / rel)
    (dest / "tests").mkdir()
    for test in tests:
        shutil.copyfile(test, dest / "tests" / test.name)
    if bench:
        (dest / "bench").mkdir()
        for src in (bench, *bench_files):
            shutil.copyfile(src, dest / "bench" / src.name)
    for packed in archives:
        shutil.copyfile(packed, dest / packed.name)
    (dest / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")

    files = sorted(p for p in dest.rglob("*") if p.is_file())
    sizes = {str(p.relative_to(dest)): p.stat().st_size for p in files}
    total = sum(sizes.values())
    manifest = {"vllm": version, "total_bytes": total, "files": sizes}
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if total + beside > CARRY_LIMIT:
        raise ValueError(
            f"stage is {total / 2**20:.2f} MiB and the working tree "
            f"{beside / 2**20:.2f} MiB; the GPU machine takes "
            f"{CARRY_LIMIT / 2**20:.0f} MiB in all"
        )
    return dest


_UNPACK = (
    "import lzma,pathlib,sys,tarfile;"
    "[(tarfile.open(p).extractall(p.parent) if p.name.endswith('.tar.xz') else"
    " p.with_suffix('').write_bytes(lzma.decompress(p.read_bytes())),p.unlink())"
    " for p in list(pathlib.Path(sys.argv[1]).rglob('*.xz'))]"
)


def device_command(
    stage_rel: str,
    *,
    bench: bool = False,
    script: str = BENCH_SCRIPT,
    tests: bool = True,
    test_timeout_s: int = 300,
    bench_timeout_s: int = 420,
) -> str:
    """The shell command that runs the stage at `stage_rel` (relative to the
    repository root) on the GPU machine, writing its results to `$OUT`. The exit
    status is pytest's, or 3 when only the benchmark failed.
    """
    src = shlex.quote(stage_rel.rstrip("/") + "/.")
    steps = [
        "set -o pipefail",
        "S=/tmp/gpustage",
        f"rm -rf $S && mkdir -p $S && cp -r {src} $S/",
        f'python3 -c "{_UNPACK}" $S || exit 90',
        "cd $S",
        "export PYTHONPATH=$S PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws",
        (
            "(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;"
            " python3 -c 'import torch;print(torch.__version__,torch.version.cuda)')"
            " >$OUT/device.txt 2>&1"
        ),
    ]
    if tests:
        steps += [
            (
                f"timeout {test_timeout_s} python3 -m pytest -p no:cacheprovider"
                " --noconftest -rA -v --junitxml=$OUT/junit.xml tests 2>&1"
                " | tee $OUT/pytest.log"
            ),
            "rc=$?",
        ]
    else:
        steps.append("rc=0")
    if bench:
        steps += [
            (
                f"timeout {bench_timeout_s} python3 bench/{shlex.quote(script)}"
                " --json $OUT/bench.json 2>&1 | tee $OUT/bench.log"
                " || { [ $rc -eq 0 ] && rc=3; }"
            ),
        ]
    steps.append("exit $rc")
    return "; ".join(steps)


def _summary(junit: Path, outcomes: dict[str, str]) -> list[str]:
    named = {o: [n for n, got in outcomes.items() if got == o] for o in OUTCOMES}
    counts = ", ".join(f"{len(named[o])} {o}" for o in OUTCOMES)
    lines = [f"{junit.name}: {counts}"]
    for label in ("failed", "error", "skipped"):
        lines += [f"  {label}: {n}" for n in named[label]]
    return lines


def compare_trees(
    pristine: dict[str, str], patched: dict[str, str], base_failures: set[str]
) -> list[str]:
    """What differs between the pristine and the patched run of the same
    tests beyond what the series claims: every test in both with the same
    outcome, except `base_failures`, which must fail (or error) pristine
    and pass patched. One line per departure; none when they agree."""
    problems = []
    for node in sorted(set(pristine) | set(patched)):
        before, after = pristine.get(node, "absent"), patched.get(node, "absent")
        if node in base_failures:
            if before not in ("failed", "error") or after != "passed":
                problems.append(
                    f"  {node}: {before} pristine, {after} patched (the series "
                    "claims: red pristine, passed patched)"
                )
        elif before != after:
            problems.append(f"  {node}: {before} pristine, {after} patched")
    return problems


def collect(files_dir: Path, dest: Path, base_failures: set[str] | None = None) -> str:
    """Copy what one device run sent back (`files_dir`, apart from `dest`) into
    `dest`, whole or not at all; summarise it. A run without a benchmark log or a
    `junit*.xml`, or with one that does not parse, raises PatchsetError and leaves
    `dest` untouched.
    """
    src, out = files_dir.resolve(), dest.resolve()
    fresh = out.with_name(out.name + ".incoming")
    old = out.with_name(out.name + ".previous")
    if any(src == o or o in src.parents or src in o.parents for o in (out, fresh, old)):
        raise PatchsetError(
            f"{files_dir}: is the results folder {dest} (or its .incoming or "
            ".previous) or overlaps it; name the folder the run's $OUT files "
            "came back to"
        )
    if not src.is_dir():
        raise PatchsetError(f"{files_dir}: no such folder")
    kept = f"nothing collected ({dest} left as it was)"
    if links := sorted(p.name for p in src.iterdir() if p.is_symlink()):
        raise PatchsetError(f"{files_dir}: symbolic links ({links[0]}, ...); {kept}")
    files = sorted(p for p in src.iterdir() if p.is_file())
    junits = [p for p in files if p.name.startswith("junit") and p.suffix == ".xml"]
    if not junits and not (src / "bench.log").is_file():
        raise PatchsetError(
            f"{files_dir}: no junit*.xml and no bench.log: the run produced no "
            f"results; {kept}"
        )
    if not (src / "device.txt").is_file():
        raise PatchsetError(
            f"{files_dir}: no device.txt, which this project's GPU stage writes "
            f"first: not its run; {kept}"
        )
    results: dict[str, dict[str, str]] = {}
    for junit in junits:
        try:
            results[junit.name] = read_outcomes(junit)
        except (ET.ParseError, ValueError) as exc:
            raise PatchsetError(
                f"{junit}: not readable junit XML ({exc}); the run did not "
                f"finish; {kept}"
            ) from exc
        if not results[junit.name]:
            raise PatchsetError(f"{junit}: holds no test; {kept}")
    pair = ("junit-pristine.xml", "junit-patched.xml")
    if sum(name in results for name in pair) == 1:
        raise PatchsetError(f"{files_dir}: the results of one tree alone; {kept}")
    for stale in (fresh, old):
        if stale.exists():
            shutil.rmtree(stale)
    fresh.mkdir(parents=True)
    for path in files:
        shutil.copyfile(path, fresh / path.name)
    if out.exists():
        out.replace(old)
    fresh.replace(out)
    if old.exists():
        shutil.rmtree(old)
    device = (out / "device.txt").read_text(errors="replace").splitlines()
    lines = [f"collected {len(files)} file(s) into {dest}"]
    lines.append(f"device, as the run recorded it: {(device or ['none'])[0]}")
    for name, outcomes in results.items():
        lines += _summary(Path(name), outcomes)
    if all(name in results for name in pair):
        pristine, patched = results[pair[0]], results[pair[1]]
        claimed = base_failures or set()
        lacking = sorted(claimed - set(pristine) - set(patched))
        problems = compare_trees(pristine, patched, claimed)
        held = len(claimed) - len(lacking)
        lines.append(
            f"pristine vs patched: every test the same but the {held} claimed "
            "fix(es) the run holds (red pristine, passed patched)"
            if not problems
            else "pristine vs patched: departures:"
        )
        lines += problems
        if lacking:
            lines.append(
                f"claimed fixes the run lacks ({len(lacking)}; it vouches for "
                "none of them):"
            )
            lines += [f"  {node}" for node in lacking]
    if (out / "bench.log").exists():
        lines.append(f"  benchmark: {dest / 'bench.log'}")
    return "\n".join(lines)


FATBIN_MAGIC = 0xBA55ED50
SM90 = 90
ELF_KIND, PTX_KIND = 2, 1


def _fatbin_section(data: bytes) -> tuple[int, int] | None:
    """Offset and size of the ELF64 section `.nv_fatbin` of `data`, if any."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 shared library")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [
        struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    strtab = headers[shstrndx][4]
    for name_at, _type, _flags, _addr, offset, size in headers:
        start = strtab + name_at
        if data[start : data.index(b"\0", start)] == b".nv_fatbin":
            return offset, size
    return None


def sm90_only(library: bytes) -> bytes:
    """The shared library `library` with only SM90 device code.

    Each fat binary keeps its SM90 cubins, else its newest PTX up to compute_90,
    else its smallest entry (one with no entry would not register). Kept entries
    move to the front, the freed bytes become zeros; offsets, sizes and symbols of
    the library stay as they were.
    """
    section = _fatbin_section(library)
    if section is None:
        return library
    data = bytearray(library)
    offset, size = section
    end = offset + size
    at = offset
    while at + 16 <= end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, at)
        if magic != FATBIN_MAGIC:
            at = (at + 8) & ~7  # fat binaries are 8-byte aligned
            continue
        body = at + header_size
        fat_end = body + fat_size
        if fat_end > end:
            raise ValueError(f"fat binary at {at:#x} runs past its section")
        entries = []
        cursor = body
        while cursor < fat_end:
            kind, _, entry_header, entry_size = struct.unpack_from(
                "<HHIQ", data, cursor
            )
            (arch,) = struct.unpack_from("<I", data, cursor + 28)
            length = entry_header + entry_size
            entries.append((kind, arch, bytes(data[cursor : cursor + length])))
            cursor += length
        keep = [e for e in entries if e[0] == ELF_KIND and e[1] == SM90]
        if not keep:
            ptx = [e for e in entries if e[0] == PTX_KIND and e[1] <= SM90]
            newest = max((e[1] for e in ptx), default=None)
            keep = [e for e in ptx if e[1] == newest]
        if not keep and entries:
            keep = [min(entries, key=lambda e: len(e[2]))]
        kept = b"".join(e[2] for e in keep)
        struct.pack_into("<Q", data, at + 8, len(kept))
        data[body : body + len(kept)] = kept
        data[body + len(kept) : fat_end] = bytes(fat_end - body - len(kept))
        at = fat_end
    return bytes(data)
