# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU stage's FlashInfer archive and its unpacking on the device."""

import lzma
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from patchset_tool import gpu, gpu_flashinfer


def fake_site_packages(root: Path) -> Path:
    """A site-packages with FlashInfer's layout, a file per package, a
    package the archive leaves out, and both distributions' metadata."""
    site = root / "site-packages"
    pkg = site / "flashinfer"
    for rel in gpu_flashinfer.PACKAGES:
        (pkg / rel).mkdir(parents=True, exist_ok=True)
        (pkg / rel / "__init__.py").write_text(f"# {rel or 'top'}: imports all\n")
    (pkg / "comm").mkdir()
    (pkg / "comm" / "nccl_only.py").write_text("import nccl4py\n")
    (pkg / "data" / "csrc").mkdir(parents=True)
    for source in (*gpu_flashinfer.CSRC, "unrelated_kernel.cu"):
        (pkg / "data" / "csrc" / source).write_text(f"// {source}\n")
    (site / "flashinfer_python-0.7.4.dist-info").mkdir()
    (site / "apache_tvm_ffi-0.1.11.dist-info").mkdir()
    return site


def fake_tvm_ffi_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("tvm_ffi/", "")  # a directory entry, as wheels have
        whl.writestr("tvm_ffi/__init__.py", "")
        whl.writestr("tvm_ffi/lib/libtvm_ffi.so", b"\x7fELF")
        whl.writestr("tvm_ffi/3rdparty/libbacktrace/configure", "#!/bin/sh\n")
        whl.writestr("apache_tvm_ffi-0.1.11.dist-info/METADATA", "")
    return path


@pytest.fixture
def archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = fake_site_packages(tmp_path)
    module = tmp_path / "mla.so"
    module.write_bytes(b"\x7fELF module")
    built: list[str] = []

    def build_modules(python: Path, work: Path) -> list[tuple[str, Path]]:
        built.append(str(python))
        return [("batch_mla_fa3_sm90", module)]

    monkeypatch.setattr(gpu_flashinfer, "build_modules", build_modules)
    monkeypatch.setattr(
        gpu_flashinfer,
        "tvm_ffi_wheel",
        lambda version, wheels: fake_tvm_ffi_wheel(tmp_path / "tvm.whl"),
    )
    first = gpu_flashinfer.archive(site, Path("python"), tmp_path / "cache")
    again = gpu_flashinfer.archive(site, Path("python"), tmp_path / "cache")
    assert again == first and len(built) == 1, "made once per version"
    return first


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
        }


def test_top_level_init_imports_nothing_but_the_version(archive: Path) -> None:
    init = members(archive)["flashinfer/__init__.py"].decode()
    assert init == gpu_flashinfer.STUBS["flashinfer/__init__.py"]


def test_cute_dsl_init_imports_no_gemm_package(archive: Path) -> None:
    init = members(archive)["flashinfer/cute_dsl/__init__.py"].decode()
    assert init == gpu_flashinfer.STUBS["flashinfer/cute_dsl/__init__.py"]


def test_only_the_mla_packages_and_sources_travel(archive: Path) -> None:
    names = set(members(archive))
    assert "flashinfer/mla/_batch_mla/__init__.py" in names
    assert "flashinfer/comm/nccl_only.py" not in names
    assert "flashinfer/data/csrc/batch_mla_config.jinja" in names
    assert "flashinfer/data/csrc/unrelated_kernel.cu" not in names


def test_prebuilt_module_sits_where_flashinfer_looks_first(archive: Path) -> None:
    aot = "flashinfer/data/aot/batch_mla_fa3_sm90/batch_mla_fa3_sm90.so"
    assert members(archive)[aot] == b"\x7fELF module"


def test_tvm_ffi_travels_without_directory_entries_or_sources(
    archive: Path,
) -> None:
    names = set(members(archive))
    assert {"tvm_ffi/__init__.py", "tvm_ffi/lib/libtvm_ffi.so"} <= names
    assert "tvm_ffi/" not in names
    assert not any(n.startswith("tvm_ffi/3rdparty/") for n in names)


def test_device_unpack_extracts_archives_and_plain_xz(
    archive: Path, tmp_path: Path
) -> None:
    stage = tmp_path / "stage"
    (stage / "vllm").mkdir(parents=True)
    (stage / "vllm" / "ext.so.xz").write_bytes(lzma.compress(b"extension"))
    (stage / archive.name).write_bytes(archive.read_bytes())
    subprocess.run([sys.executable, "-c", gpu._UNPACK, str(stage)], check=True)
    assert (stage / "vllm" / "ext.so").read_bytes() == b"extension"
    assert (stage / "tvm_ffi" / "lib" / "libtvm_ffi.so").is_file()
    assert not list(stage.rglob("*.xz"))
