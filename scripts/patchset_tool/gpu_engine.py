# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset gpu --engine`: vLLM itself, pristine and patched, for the GPU machine.

The GPU machine has Python 3.12, torch and no vLLM, and takes 64 MiB a call, so
the engine stage is cut into parts that each fit one call (an item larger than
one call travels in `split` pieces). Unpacked in turn on one warm machine by
`gpu_device.py` (in every part as `engine.py`), they make vLLM importable there:
the wheel's SM90-only extensions (`ext-*.xz`), its Python files pristine and
patched, the release's tests, FlashInfer's SM90 MLA modules (primary base) and
the cp312 wheels of `WHEELS`.
"""

import hashlib
import io
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from . import envmgr, gitutil, gpu, gpu_flashinfer, paths, trees, upstream
from .digests import file_sha256
from .errors import PatchsetError
from .series import Series

DEVICE_SCRIPT = Path(__file__).with_name("gpu_device.py")

WHEELS = (
    "annotated-types",
    "anthropic",
    "apache-tvm-ffi",
    "astor",
    "blake3",
    "cachetools",
    "cbor2",
    "compressed-tensors",
    "depyf",
    "dill",
    "docstring-parser",
    "email-validator",
    "fastapi",
    "httpcore2",
    "httpx2",
    "ijson",
    "interegular",
    "jiter",
    "jsonschema",
    "jsonschema-specifications",
    "lark",
    "llguidance",
    "lm-format-enforcer",
    "loguru",
    "mistral-common",
    "msgspec",
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu13",
    "openai",
    "opentelemetry-api",
    "orjson",
    "oss-harmony",
    "outlines-core",
    "partial-json-parser",
    "prometheus-fastapi-instrumentator",
    "pybase64",
    "pydantic",
    "pydantic-core",
    "pydantic-extra-types",
    "python-json-logger",
    "python-multipart",
    "pyzmq",
    "quack-kernels",
    "referencing",
    "rpds-py",
    "setproctitle",
    "sniffio",
    "starlette",
    "tblib",
    "tilelang",
    "torch-c-dlpack-ext",
    "truststore",
    "typing-inspection",
    "uvicorn",
    "watchfiles",
    "xgrammar",
    "z3-solver",
)
"""Distributions vLLM 0.34.0's engine, its entry points, upstream's
tests/conftest.py and the tests/utils.py its `dist_init` imports need that
the GPU machine's image lacks (its list: the device's KINDS.md), found by
importing them on CPU in a Python 3.12 venv holding only that image's
packages (`tests/patchset/test_gpu_engine.py`). Every CUDA engine's
`kernel_warmup` imports MiniMax-M3's warmup, which imports the CuTe DSL
(`cutlass`, the `[cu13]` flavour vLLM's wheel requires) and quack; mHC
(`mhc: true`) runs tilelang's kernels, which need z3 and torch-c-dlpack-ext."""

PY_SKIP = ("vllm/vllm-rs", "vllm/third_party/fmha_sm100/")
"""Wheel files the stage leaves out: the 64 MB `vllm-rs` binary (a Rust
front end nothing here starts) and the SM100-only FMHA headers."""

EXT_SKIP = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",)
"""Extensions left out: FlashAttention 2 (34 MB compressed), which vLLM imports
only if present and uses on pre-Hopper GPUs; SM90 runs FlashAttention 3."""

PART_MARGIN = 2 * 1024 * 1024
"""Room left in each call beside the part and the working tree."""

PRUNE_VERSION = "sm90-1"
"""Changes with `gpu.sm90_only`, so cached extensions are remade."""


def extension_xz(src: Path, cache_dir: Path) -> Path:
    """`src` with SM90 device code only, stripped, xz-compressed; cached
    by the source's content."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"{file_sha256(src)}-{PRUNE_VERSION}.xz"
    if out.exists():
        return out
    data = gpu.sm90_only(src.read_bytes())
    tmp = cache_dir / f"{out.name}.so.tmp"
    tmp.write_bytes(data)
    strip = shutil.which("strip")
    if strip:
        subprocess.run([strip, "--strip-unneeded", str(tmp)], check=True)
    part = out.with_suffix(".part")
    part.write_bytes(lzma.compress(tmp.read_bytes(), preset=6))
    tmp.unlink()
    part.replace(out)
    return out


def _write_tar_xz(dest: Path, members: list[tuple[str, bytes]]) -> Path:
    """`members` as an xz-compressed tar at `dest`, made once per content
    (cached in the cache's `gpu-engine-tar/`)."""
    digest = hashlib.sha256()
    for name, data in members:
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    cached = paths.cache_root() / "gpu-engine-tar" / f"{digest.hexdigest()}.tar.xz"
    if cached.exists():
        return Path(shutil.copyfile(cached, dest))
    cached.parent.mkdir(parents=True, exist_ok=True)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    partial = cached.with_suffix(".part")
    partial.write_bytes(lzma.compress(raw.getvalue(), preset=6))
    partial.replace(cached)
    return Path(shutil.copyfile(cached, dest))


def python_members(site_packages: Path, version: str) -> list[tuple[str, bytes]]:
    """The wheel's Python files and data (no extensions, no bytecode) and
    its dist-info, as archive members."""
    members = []
    for root in (site_packages / "vllm", site_packages / f"vllm-{version}.dist-info"):
        for src in sorted(root.rglob("*")):
            rel = src.relative_to(site_packages).as_posix()
            skip = rel.startswith(PY_SKIP) or src.suffix in (".so", ".pyc")
            if src.is_file() and not skip:
                members.append((rel, src.read_bytes()))
    return members


def source_members(series: Series) -> list[tuple[str, bytes]]:
    """The release's `tests/` and `pyproject.toml` with the series' test
    files added (their overlay copies), as archive members."""
    base = series.base
    history = upstream.release_history()
    members = []
    with tempfile.TemporaryDirectory(prefix="patchset-engine-") as tmp:
        tar_path = Path(tmp) / "src.tar"
        gitutil.git(
            "archive", "--format=tar", "-o", str(tar_path), base.tag, "tests",
            "pyproject.toml", cwd=history,
        )  # fmt: skip
        with tarfile.open(tar_path) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    members.append((member.name, data))
    ours = {path: base.copy_of(path).read_bytes() for path in series.test_files}
    members = [(n, d) for n, d in members if n not in ours]
    return members + sorted(ours.items())


def patched_members(series: Series) -> list[tuple[str, bytes]]:
    """The files of the vllm package the series changes, as the patched tree
    has them."""
    tree = series.base.patched_tree()
    return [
        (path, (tree / path).read_bytes())
        for path in sorted(series.touched)
        if path.startswith("vllm/") and (tree / path).is_file()
    ]


def wheel(name: str, version: str, wheels: Path) -> Path:
    """The cp312 x86-64 wheel of `name==version`, downloaded once."""
    stem = name.replace("-", "_").lower()
    wheels.mkdir(parents=True, exist_ok=True)

    def found() -> list[Path]:
        return [
            w
            for w in sorted(wheels.glob("*.whl"))
            if w.name.lower().startswith(f"{stem}-{version}-")
        ]

    if not found():
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_24_x86_64", "--platform",
            "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
            "--platform", "manylinux_2_31_x86_64", "--platform",
            "manylinux_2_34_x86_64", "--platform", "manylinux_2_35_x86_64",
            "--platform", "any", "-d", str(wheels), f"{name}=={version}",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not found():
            raise PatchsetError(
                f"could not download a cp312 wheel of {name}=={version} for the "
                "GPU machine; check pip's index configuration"
            )
    return found()[0]


def _version(site_packages: Path, name: str) -> str:
    return gpu_flashinfer.dist_version(site_packages, name.lower())


def pack_parts(items: list[Path], dest: Path, budget: int) -> list[str]:
    """Copy `items` into `dest/part1`, `part2`, ... (largest first, each
    part under `budget` bytes); return the part names."""
    parts: list[tuple[str, int]] = []
    for item in sorted(items, key=lambda p: p.stat().st_size, reverse=True):
        size = item.stat().st_size
        if size > budget:
            raise PatchsetError(
                f"{item.name} is {size / 2**20:.1f} MiB: no call takes more "
                f"than {budget / 2**20:.1f} MiB beside the working tree"
            )
        index = next(
            (i for i, (_, used) in enumerate(parts) if used + size <= budget), None
        )
        if index is None:
            parts.append((f"part{len(parts) + 1}", 0))
            index = len(parts) - 1
        name, used = parts[index]
        (dest / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(item, dest / name / item.name)
        parts[index] = (name, used + size)
    return [name for name, _ in parts]


def split(item: Path, budget: int) -> list[Path]:
    """`item` itself, or pieces of it named `NAME.I-of-N.split` (each under
    `budget` bytes) that the device script joins once all are unpacked."""
    data = item.read_bytes()
    count = -(-len(data) // budget)
    if count <= 1:
        return [item]
    step = -(-len(data) // count)
    pieces = []
    for i in range(count):
        piece = item.with_name(f"{item.name}.{i + 1}-of-{count}.split")
        piece.write_bytes(data[i * step : (i + 1) * step])
        pieces.append(piece)
    item.unlink()
    return pieces


def build(series: Series, dest: Path, *, with_flashinfer: bool = True) -> dict:
    """Write the engine stage of `series` into `dest` (absent) and
    return its manifest (`MANIFEST.json`, also in every part)."""
    base = series.base
    python = envmgr.env_python(base)
    assert python is not None
    site = envmgr.site_packages(python)
    version = gpu.vllm_version(site)
    cache = paths.cache_root()
    work = dest / ".work"
    work.mkdir(parents=True)
    trees.mark(dest, "gpu-engine-stage")
    items: list[Path] = []
    for so in sorted((site / "vllm").rglob("*.so")):
        rel = so.relative_to(site).as_posix()
        if rel in EXT_SKIP:
            continue
        packed = extension_xz(so, cache / "gpu-engine-xz")
        items.append(shutil.copyfile(packed, work / f"ext-{rel.replace('/', '+')}.xz"))
    items.append(_write_tar_xz(work / "vllm-py.tar.xz", python_members(site, version)))
    items.append(_write_tar_xz(work / "vllm-patched.tar.xz", patched_members(series)))
    items.append(_write_tar_xz(work / "src.tar.xz", source_members(series)))
    if with_flashinfer and base.primary:
        archive = gpu_flashinfer.archive(site, python, cache / "gpu-flashinfer")
        items.append(shutil.copyfile(archive, work / "flashinfer.tar.xz"))
    for name in WHEELS:
        found = wheel(name, _version(site, name), cache / "gpu-wheels")
        items.append(shutil.copyfile(found, work / found.name))
    beside = gitutil.working_tree_bytes(paths.REPO)
    budget = gpu.CARRY_LIMIT - beside - PART_MARGIN
    items = [piece for item in items for piece in split(item, budget)]
    names = pack_parts(items, dest, budget)
    shutil.rmtree(work)
    sizes = {
        name: sum(f.stat().st_size for f in (dest / name).iterdir()) for name in names
    }
    manifest = {
        "vllm": version,
        "series": series.short_id,
        "parts": names,
        "part_bytes": sizes,
        "total_bytes": sum(sizes.values()),
        "wheels": len(WHEELS),
    }
    for name in names:
        shutil.copyfile(DEVICE_SCRIPT, dest / name / "engine.py")
        (dest / name / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def device_commands(stage_rel: str, parts: list[str]) -> list[str]:
    """The calls to make on one warm machine, in order: one `unpack` per
    part, the last one followed by the tests."""
    calls = [f"python3 {stage_rel}/{part}/engine.py unpack" for part in parts]
    last = f"{stage_rel}/{parts[-1]}/engine.py"
    calls[-1] += f" && python3 {last} tests"
    return calls


def stage_engine(series: Series) -> str:
    """Stage vLLM's engine for the GPU machine; return what to run there."""
    base = series.base
    dest = paths.build_dir() / "gpu" / f"engine-{base.version}"
    trees.claim_folder(dest, "the engine stage", kind="gpu-engine-stage")
    manifest = gitutil.publish_folder(dest, lambda new: build(series, new))
    stage_rel = dest.relative_to(paths.REPO).as_posix()
    calls = device_commands(stage_rel, manifest["parts"])
    lines = [
        (
            f"staged vLLM {base.version}'s engine (pristine and patched, series "
            f"{manifest['series']}) in {dest}: {len(calls)} part(s), "
            f"{manifest['total_bytes'] / 2**20:.1f} MiB."
        ),
        (
            "On one warm GPU machine (it forgets them after 30 s idle), one "
            "call per part, each carrying only its part:"
        ),
    ]
    lines += [
        f"  {i}. carry {stage_rel}/{part}: {call}"
        for i, (part, call) in enumerate(zip(manifest["parts"], calls), 1)
    ]
    lines.append(
        "then bring back $OUT and run: "
        f"scripts/patchset gpu --base {base.version} --collect DIR"
    )
    return "\n".join(lines)
