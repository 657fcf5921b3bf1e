# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer's SM90 MLA kernels, packed for a GPU machine without FlashInfer.

FlashInfer's top-level import needs packages the GPU machine lacks, so the
archive holds only what `BatchMLAPagedAttentionWrapper` (backend `fa3`) needs:
the Python files of `PACKAGES` with import-free stubs (`STUBS`), the two SM90
MLA modules GLM's geometry uses, compiled here ahead of time, and `tvm_ffi`
from its cp312 wheel. The archive is cached by its inputs.
"""

import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from .errors import PatchsetError

PACKAGES = (
    "",
    "autotuner",
    "cute_dsl",
    "jit",
    "jit/attention",
    "jit/attention/fmha_v2",
    "jit/gemm",
    "jit/gemm/cutlass",
    "mla",
    "mla/_batch_mla",
    "mla/_batch_mla/_backends",
    "trace",
    "trace/templates",
)
"""FlashInfer's packages (relative to `flashinfer/`) that `import flashinfer.mla`
and the wrapper's plan and run load when the top-level import is empty."""

CSRC = (
    "batch_mla_config.jinja",
    "batch_mla_sm90_binding.cu",
    "batch_mla_sm90_plan.cu",
    "batch_mla_sm90_run.cu",
)
"""The module's sources under `data/csrc`: FlashInfer renders its config and
copies them on every call, before it finds the prebuilt module."""

STUBS = {
    "flashinfer/__init__.py": (
        "from .version import __version__, __git_commit__, __git_version__\n"
    ),
    # With the CuTe DSL installed (vLLM requires it) the real one imports
    # FlashInfer's GEMM packages, which the archive leaves out; the MLA
    # wrapper's backends import only submodules of it.
    "flashinfer/cute_dsl/__init__.py": "from .availability import *  # noqa\n",
}

TVM_FFI_SKIP = ("tvm_ffi/3rdparty/", "tvm_ffi/src/")

BUILD_SCRIPT = """
import json, sys, torch
from flashinfer.jit.attention.modules import gen_batch_mla_module
built = []
for kv in (torch.bfloat16, torch.float8_e4m3fn):
    spec = gen_batch_mla_module(
        "fa3", torch.bfloat16, kv, torch.bfloat16, torch.int32, 512, 0, False
    )
    spec.build()
    built.append([spec.name, str(spec.get_library_path())])
print(json.dumps(built))
"""
"""Builds the modules FLASHINFER_MLA_SPARSE_SM90 plans at GLM's geometry:
query and output BF16, int32 indices, ckv 512, kpe 0 (NoPE), no profiler."""


def dist_version(site_packages: Path, name: str) -> str:
    """The version of distribution `name` installed in `site_packages`."""
    prefix = name.replace("-", "_") + "-"
    for info in site_packages.glob(f"{prefix}*.dist-info"):
        return info.name[len(prefix) : -len(".dist-info")]
    raise PatchsetError(f"{site_packages}: {name} is not installed")


def build_modules(python: Path, work: Path) -> list[tuple[str, Path]]:
    """Compile the SM90 MLA modules with FlashInfer's JIT in `python`'s env.

    Needs a CUDA toolkit (`CUDA_HOME`, /usr/local/cuda, or the one whose
    nvcc is on PATH); links against a stub
    `libcuda.so` made in `work`, since no driver is needed to compile.
    """
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parents[1]))
    cuda_home = next(
        (c for c in candidates if c and (Path(c) / "lib64").is_dir()), None
    )
    if cuda_home is None or not (Path(cuda_home) / "bin" / "nvcc").exists():
        raise PatchsetError(
            "FlashInfer's SM90 MLA modules are compiled here: no CUDA toolkit "
            "with nvcc found (set CUDA_HOME)"
        )
    stub = work / "stub"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "empty.c").write_text("\n")
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(stub / "libcuda.so"),
            str(stub / "empty.c"),
        ],
        check=True,
    )
    env = dict(
        os.environ,
        CUDA_HOME=cuda_home,
        FLASHINFER_WORKSPACE_BASE=str(work / "jit"),
        FLASHINFER_CUDA_ARCH_LIST="9.0a",
        FLASHINFER_EXTRA_LDFLAGS=f"-L{stub}",
    )
    done = subprocess.run(
        [str(python), "-c", BUILD_SCRIPT], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise PatchsetError(
            f"compiling FlashInfer's SM90 MLA modules failed: {tail[0]}"
        )
    return [(name, Path(lib)) for name, lib in json.loads(done.stdout.splitlines()[-1])]


def tvm_ffi_wheel(version: str, wheels: Path) -> Path:
    """apache-tvm-ffi `version` as a cp312 manylinux wheel, downloaded once."""
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"apache_tvm_ffi-{version}-cp312-*.whl"))
    if found:
        return found[0]
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
        "--platform", "manylinux_2_17_x86_64", "-d", str(wheels),
        f"apache-tvm-ffi=={version}",
    ]  # fmt: skip
    if subprocess.run(cmd).returncode != 0:
        raise PatchsetError(f"could not download apache-tvm-ffi {version} for cp312")
    found = sorted(wheels.glob(f"apache_tvm_ffi-{version}-cp312-*.whl"))
    if not found:
        raise PatchsetError(f"pip gave no cp312 wheel of apache-tvm-ffi {version}")
    return found[0]


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def archive(site_packages: Path, python: Path, cache_dir: Path) -> Path:
    """The FlashInfer archive for the env of `python` (see the module doc),
    made once per FlashInfer and tvm-ffi version in `cache_dir`."""
    fi_version = dist_version(site_packages, "flashinfer_python")
    tvm_version = dist_version(site_packages, "apache_tvm_ffi")
    key = hashlib.sha256(
        f"{fi_version}\0{tvm_version}\0{BUILD_SCRIPT}\0{PACKAGES}\0{CSRC}\0{STUBS}".encode()
    ).hexdigest()[:16]
    out = cache_dir / f"flashinfer-{fi_version}-{key}.tar.xz"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel = tvm_ffi_wheel(tvm_version, cache_dir / "wheels")
    pkg = site_packages / "flashinfer"
    with tempfile.TemporaryDirectory(prefix="patchset-fi-") as tmp:
        modules = build_modules(python, Path(tmp))
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            for rel in PACKAGES:
                for src in sorted((pkg / rel).glob("*.py")):
                    name = f"flashinfer/{src.relative_to(pkg).as_posix()}"
                    data = STUBS.get(name, "").encode() or src.read_bytes()
                    _add(tar, name, data)
            for source in CSRC:
                data = (pkg / "data" / "csrc" / source).read_bytes()
                _add(tar, f"flashinfer/data/csrc/{source}", data)
            for name, lib in modules:
                so = f"flashinfer/data/aot/{name}/{name}.so"
                _add(tar, so, lib.read_bytes(), 0o755)
            with zipfile.ZipFile(wheel) as whl:
                for member in whl.namelist():
                    if (
                        member.startswith("tvm_ffi/")
                        and not member.endswith("/")
                        and not member.startswith(TVM_FFI_SKIP)
                    ):
                        _add(tar, member, whl.read(member), 0o755)
        tmp_out = out.with_suffix(".tmp")
        tmp_out.write_bytes(
            lzma.compress(raw.getvalue(), preset=9 | lzma.PRESET_EXTREME)
        )
        tmp_out.replace(out)
    return out
