# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset build` and `patchset verify-install`, for every base with a
series: the wheel's contents, installing it with uv into a scratch venv
(whose dependencies are the managed environment's, reached through a .pth
file), the patched modules imported from that install, drift detection, going back
to upstream, and every kind of bad input (nothing may be left in dist/).

The upstream wheels come from the tool's cache (downloaded once)."""

import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from projectkit import REPO, in_mount_namespace, needs_unshare

from patchset_tool import envmgr, trees, wheel
from patchset_tool.bases import Base, load_bases
from patchset_tool.digests import record_digest, record_hash
from patchset_tool.distinfo import find_vllm
from patchset_tool.installed import purelib
from patchset_tool.runner import vllm_cache_root
from patchset_tool.series import SERIES_FILE, Series

BASES = [b for b in load_bases() if b.series_file.is_file()]
Completed = subprocess.CompletedProcess[str]


def patchset(*args: str, env: dict[str, str] | None = None) -> Completed:
    """Run a subcommand of `scripts/patchset`."""
    command = [sys.executable, str(REPO / "scripts" / "patchset"), *args]
    return subprocess.run(
        command, cwd=REPO, env=env or tool_env(), capture_output=True, text=True
    )


def tool_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "scripts"), **extra}


def uv(*args: str) -> Completed:
    """uv, offline, with a throw-away cache (nothing linked from a shared one)."""
    command = [str(envmgr.uv_exe()), *args, "--offline", "--no-cache"]
    return subprocess.run(command, capture_output=True, text=True)


def leftovers(folder: Path) -> list[str]:
    """What `folder` holds, but the marker that makes a dist folder the tool's."""
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name != trees.MARKER)


def zip_record(archive: zipfile.ZipFile, dist_info: str) -> dict[str, list[str]]:
    text = archive.read(f"{dist_info}/RECORD").decode()
    return {row[0]: row[1:] for row in csv.reader(io.StringIO(text))}


def base_param(base: Base) -> object:
    """`base` as a parameter; one base's tests share its wheel and venv, so
    they stay on one xdist worker."""
    return pytest.param(
        base, id=base.version, marks=pytest.mark.xdist_group(f"wheel-{base.version}")
    )


PRIMARY_ONLY = {"test_installed_wheel_is_the_overlay_and_its_modules_import"}
"""Tests run for the primary base alone: the other bases' wheels come from
the same code and verify-install proves their files, while importing the
patched modules from an install costs a fresh vLLM import and bytecode
compile."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "base" in metafunc.fixturenames:
        only_primary = metafunc.function.__name__ in PRIMARY_ONLY
        chosen = [b for b in BASES if b.primary or not only_primary]
        params = [base_param(b) for b in chosen]
        metafunc.parametrize("base", params, indirect=True, scope="module")


@pytest.fixture(scope="module")
def base(request: pytest.FixtureRequest) -> Base:
    return request.param


@pytest.fixture(scope="module")
def upstream(base: Base) -> wheel.UpstreamWheel:
    return wheel.upstream_wheel(base.version)


@pytest.fixture(scope="module")
def built(
    base: Base, upstream: wheel.UpstreamWheel, tmp_path_factory
) -> Iterator[Path]:
    """The wheel `scripts/patchset build` writes, checked to be the only
    file in dist/ (removed afterwards: pytest keeps old temporary folders)."""
    dist = tmp_path_factory.mktemp("dist")
    result = patchset("build", "--base", base.version, "--dist", str(dist))
    assert result.returncode == 0, result.stderr
    [only] = leftovers(dist)
    path = dist / only
    assert f"built {path}" in result.stdout
    assert " MB in " in result.stdout
    assert f"uv pip install --no-deps {path}" in result.stdout
    assert f"pip install --no-deps {path}" in result.stdout
    yield path
    shutil.rmtree(dist)


@pytest.fixture(scope="module")
def venv(base: Base, built: Path, tmp_path_factory) -> Iterator[Path]:
    """A scratch venv with the built wheel installed by uv; every other
    package comes from the base's managed environment through a .pth file
    (removed afterwards)."""
    managed = envmgr.env_python(base)
    assert managed is not None
    root = tmp_path_factory.mktemp("venv") / "venv"
    made = uv("venv", "--quiet", "--python", str(managed), str(root))
    assert made.returncode == 0, made.stderr
    python = root / "bin" / "python"
    deps = envmgr.site_packages(managed)
    (purelib(python) / "_glm5next_base_deps.pth").write_text(
        f"import site; site.addsitedir({str(deps)!r})\n"
    )
    installed = uv("pip", "install", "--python", str(python), "--no-deps", str(built))
    assert installed.returncode == 0, installed.stderr
    yield python
    shutil.rmtree(root)


def test_wheel_is_upstream_plus_the_series(
    base: Base, built: Path, upstream: wheel.UpstreamWheel
) -> None:
    series = Series.load(base)
    version = series.version
    assert built.name == f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    old, new = f"vllm-{base.version}.dist-info", f"vllm-{version}.dist-info"
    with zipfile.ZipFile(upstream.path) as up, zipfile.ZipFile(built) as out:
        assert out.read(f"{new}/WHEEL") == up.read(f"{old}/WHEEL")
        before = up.read(f"{old}/METADATA").decode().splitlines()
        after = out.read(f"{new}/METADATA").decode().splitlines()
        assert [a for a, b in zip(before, after) if a != b] == [
            f"Version: {base.version}"
        ]
        assert after[before.index(f"Version: {base.version}")] == f"Version: {version}"
        assert len(after) == len(before)
        record = zip_record(out, new)
        assert record.pop(f"{new}/RECORD") == ["", ""]
        assert sorted(record) == sorted(set(out.namelist()) - {f"{new}/RECORD"})
        for name, (digest, size) in record.items():
            data = out.read(name)
            assert (record_hash(data), str(len(data))) == (digest, size), name
        changed = set(series.touched)
        upstream_record = zip_record(up, old)
        for name, row in record.items():
            if name in changed:
                assert out.read(name) == base.copy_of(name).read_bytes(), name
            elif name.startswith("vllm/") and name != SERIES_FILE:
                # every other file, compiled extensions included, is upstream's
                assert row == upstream_record[name], name


def test_series_file_names_the_series(base: Base, built: Path) -> None:
    series = Series.load(base)
    with zipfile.ZipFile(built) as out:
        manifest = out.read(SERIES_FILE)
    assert manifest == series.manifest()
    text = manifest.decode()
    assert f'"commit": "{base.commit}"' in text
    assert all(p.subject in text and p.name in text for p in series.patches)


def test_verify_install_reports_the_series(base: Base, venv: Path) -> None:
    result = patchset("verify-install", str(venv))
    assert result.returncode == 0, result.stderr
    version = Series.load(base).version
    short = version.rsplit(".", 1)[1]
    assert f"vllm: {version} (vllm-{version}.dist-info)" in result.stdout
    assert f"series: glm5next {short} on vLLM {base.version}" in result.stdout
    assert f"same series as this checkout's patches/{base.version}/" in result.stdout
    assert "files: all " in result.stdout and " match RECORD" in result.stdout


NEEDS_CUDA_DRIVER = {"vllm/platforms/cuda.py"}
"""Touched modules that do not import on a host without libcuda.so.1;
their installed bytes are still compared with the overlay."""


def test_installed_wheel_is_the_overlay_and_its_modules_import(
    base: Base, venv: Path
) -> None:
    """What only the wheel shows: the installed files the series touches are
    the overlay's, and the patched modules import from the install (the
    model tests run against the source trees in their own parts)."""
    site = purelib(venv)
    touched = [p for p in Series.load(base).touched if p.startswith("vllm/")]
    for path in touched:
        assert (site / path).read_bytes() == base.copy_of(path).read_bytes(), path
    modules = [
        p.removesuffix(".py").replace("/", ".")
        for p in touched
        if p.endswith(".py") and p not in NEEDS_CUDA_DRIVER
    ]
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CACHE_ROOT": vllm_cache_root(f"{base.version}-wheel"),
    }
    env.pop("PYTHONPATH", None)
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n"
    script += "    print(importlib.import_module(m).__file__)\n"
    result = subprocess.run(
        [str(venv), "-c", script, *modules], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    want = [str(site / m.replace(".", "/")) + ".py" for m in modules]
    assert result.stdout.split()[-len(modules) :] == want


def test_verify_install_names_a_drifted_file(base: Base, venv: Path) -> None:
    touched = Series.load(base).touched
    patched = next(p for p in touched if p.startswith("vllm/"))
    path = purelib(venv) / patched
    original = path.read_bytes()
    path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    try:
        result = patchset("verify-install", str(venv))
    finally:
        path.write_bytes(original)
    assert result.returncode == 1
    assert f"{patched}: sha256 differs from RECORD" in result.stderr
    assert "1 of the installed vLLM's files drifted" in result.stderr
    assert patchset("verify-install", str(venv)).returncode == 0


def test_reinstalling_upstream_restores_the_pristine_files(
    base: Base, venv: Path, upstream: wheel.UpstreamWheel
) -> None:
    """Runs last in the module: it takes the series out of the venv."""
    command = ["pip", "install", "--python", str(venv), "--no-deps", "--reinstall"]
    result = uv(*command, str(upstream.path))
    assert result.returncode == 0, result.stderr
    site = purelib(venv)
    install = find_vllm(site)
    assert install.version == base.version
    assert not (site / SERIES_FILE).exists()
    with zipfile.ZipFile(upstream.path) as up:
        want = zip_record(up, f"vllm-{base.version}.dist-info")
    for name, (digest, _) in want.items():
        if name.startswith("vllm/"):
            assert install.record[name] == digest, name
            assert record_digest(site / name) == digest, name
    report = patchset("verify-install", str(venv))
    assert report.returncode == 0, report.stderr
    assert f"series: none (upstream vLLM {base.version})" in report.stdout


# --- bad input: a clear error, and nothing left in dist/ ---------------------


def cache_with(tmp_path: Path, base: Base, data: bytes, sha256: str) -> Path:
    """A tool cache whose upstream wheel for `base` is `data`, recorded with
    the index digest `sha256`."""
    cache = tmp_path / "cache"
    folder = cache / "wheels"
    folder.mkdir(parents=True)
    name = wheel.upstream_wheel_name(base.version)
    (folder / name).write_bytes(data)
    (folder / f"{name}.sha256").write_text(sha256 + "\n")
    return cache


def test_damaged_cached_wheel_offline_is_named_and_kept(
    base: Base, tmp_path: Path
) -> None:
    cache = cache_with(tmp_path, base, b"not a wheel", "0" * 64)
    dist = tmp_path / "dist"
    unreachable = {
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "1",
    }
    result = patchset(
        "build",
        "--base",
        base.version,
        "--dist",
        str(dist),
        env=tool_env(GLM5NEXT_PATCHSET_CACHE=str(cache), **unreachable),
    )
    cached = cache / "wheels" / wheel.upstream_wheel_name(base.version)
    assert result.returncode == 1
    assert f"{cached}: damaged" in result.stderr
    assert "Traceback" not in result.stderr
    assert cached.read_bytes() == b"not a wheel"
    assert leftovers(dist) == []


def small_wheel(upstream: Path, base: Base, drift: str) -> bytes:
    """The upstream wheel cut down to what the build reads (the files the
    series touches, _version.py, the dist-info), with one byte of `drift`
    flipped while RECORD keeps the upstream sha256."""
    keep = set(Series.load(base).touched)
    keep.add("vllm/_version.py")
    buffer = io.BytesIO()
    with zipfile.ZipFile(upstream) as up, zipfile.ZipFile(buffer, "w") as out:
        for info in up.infolist():
            if info.filename in keep or ".dist-info/" in info.filename:
                data = up.read(info)
                if info.filename == drift:
                    data = data[:-1] + bytes([data[-1] ^ 1])
                out.writestr(info, data)
    return buffer.getvalue()


def test_drifted_base_file_is_named(
    base: Base, upstream: wheel.UpstreamWheel, tmp_path: Path
) -> None:
    touched = Series.load(base).touched
    drift = next(p for p, existed in touched.items() if existed)
    data = small_wheel(upstream.path, base, drift)
    cache = cache_with(tmp_path, base, data, hashlib.sha256(data).hexdigest())
    dist = tmp_path / "dist"
    result = patchset(
        "build",
        "--base",
        base.version,
        "--dist",
        str(dist),
        env=tool_env(GLM5NEXT_PATCHSET_CACHE=str(cache)),
    )
    assert result.returncode == 1
    assert f"{drift}: differs from the sha256 in the wheel's RECORD" in result.stderr
    assert leftovers(dist) == []


def build_in_namespace(base: Base, dist: Path, mount: str) -> tuple[Completed, str]:
    """Build into `dist` after `mount` in a private mount namespace (root
    ignores permission bits, and no real disk fills); returns the result
    and what dist/ held afterwards, as seen inside the namespace."""
    dist.mkdir()
    script = (
        f"{mount} && {sys.executable} {REPO / 'scripts' / 'patchset'} build --base "
        f"{base.version} --dist {dist}; rc=$?; echo LEFT:$(ls -A {dist}); exit $rc"
    )
    result = in_mount_namespace(script, REPO, tool_env())
    left = result.stdout.rsplit("LEFT:", 1)[-1].strip()
    return result, left


@needs_unshare
def test_full_disk_is_reported(
    base: Base, upstream: wheel.UpstreamWheel, tmp_path: Path
) -> None:
    dist = tmp_path / "dist"
    result, left = build_in_namespace(
        base, dist, f"mount -t tmpfs -o size=1m tmpfs {dist}"
    )
    assert result.returncode == 1, result.stderr
    assert f"no space left on the device of {dist}" in result.stderr
    assert "nothing was left there" in result.stderr
    assert left == ""


@needs_unshare
def test_read_only_dist_is_refused(
    base: Base, upstream: wheel.UpstreamWheel, tmp_path: Path
) -> None:
    dist = tmp_path / "dist"
    result, left = build_in_namespace(
        base, dist, f"mount --bind {dist} {dist} && mount -o remount,bind,ro {dist}"
    )
    assert result.returncode == 1, result.stderr
    assert f"cannot write the wheel to {dist}: Read-only file system" in result.stderr
    assert left == ""


def test_verify_install_without_vllm_says_so(tmp_path: Path) -> None:
    made = uv("venv", "--quiet", "--python", sys.executable, str(tmp_path / "venv"))
    assert made.returncode == 0, made.stderr
    result = patchset("verify-install", str(tmp_path / "venv" / "bin" / "python"))
    assert result.returncode == 1
    assert "vLLM is not installed there" in result.stderr


def test_metadata_keeps_every_other_byte() -> None:
    metadata = (
        b"Name: vllm\r\nVersion: 0.33.0\r\nRequires-Dist: torch\r\n\r\nVersion: body"
    )
    assert wheel.metadata_with_version(metadata, "0.33.0+glm5next.abc") == (
        b"Name: vllm\r\nVersion: 0.33.0+glm5next.abc\r\nRequires-Dist: torch\r\n"
        b"\r\nVersion: body"
    )
