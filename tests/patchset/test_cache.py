# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A damaged cache: a cached sdist is checked against its recorded sha256
on every use and fetched again (from a local index) when damaged; the
release history is built again when it lacks a release."""

import gzip
import hashlib
import http.server
import io
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from projectkit import git

from patchset_tool import bases, upstream
from patchset_tool.errors import PatchsetError

VERSION = "9.9.9"


def _sdist_bytes() -> bytes:
    """A small real sdist: vllm-<VERSION>/README in a .tar.gz."""
    data = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=data, mode="wb", mtime=0) as zipped,
        tarfile.open(fileobj=zipped, mode="w") as tar,
    ):
        text = f"vLLM {VERSION}\n".encode()
        info = tarfile.TarInfo(f"vllm-{VERSION}/README")
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    return data.getvalue()


SDIST = _sdist_bytes()


class _Index(http.server.BaseHTTPRequestHandler):
    """A PEP 503 page for vllm with one sdist and its sha256; with `cut`,
    the connection closes after half the sdist's announced length."""

    cut = False

    def do_GET(self) -> None:
        name = f"vllm-{VERSION}.tar.gz"
        if self.path.endswith("/vllm/"):
            digest = hashlib.sha256(SDIST).hexdigest()
            body = f'<a href="/files/{name}#sha256={digest}">{name}</a>'.encode()
            kind = "text/html"
        elif self.path == f"/files/{name}":
            body, kind = SDIST, "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if self.cut and body is SDIST else body)

    def log_message(self, *args: object) -> None:
        pass


def _serve(handler: type[_Index]) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    server.shutdown()


@pytest.fixture
def index() -> Iterator[str]:
    yield from _serve(_Index)


class _CutIndex(_Index):
    cut = True


@pytest.fixture
def cut_index() -> Iterator[str]:
    yield from _serve(_CutIndex)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("GLM5NEXT_PATCHSET_CACHE", str(root))
    return root


def damaged_sdist(cache: Path) -> Path:
    archive = cache / "sdists" / f"vllm-{VERSION}.tar.gz"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(SDIST[:-1] + b"Z")
    digest = hashlib.sha256(SDIST).hexdigest()
    archive.with_name(archive.name + ".sha256").write_text(digest + "\n")
    return archive


def test_sdist_is_fetched_checked_and_recorded(
    cache: Path, index: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", index)
    archive = upstream.sdist(VERSION)
    assert archive.read_bytes() == SDIST
    recorded = archive.with_name(archive.name + ".sha256").read_text()
    assert recorded == hashlib.sha256(SDIST).hexdigest() + "\n"


def test_damaged_sdist_is_named_and_fetched_again(
    cache: Path, index: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    archive = damaged_sdist(cache)
    monkeypatch.setenv("PIP_INDEX_URL", index)
    assert upstream.sdist(VERSION) == archive
    assert archive.read_bytes() == SDIST
    assert f"{archive}: damaged" in capsys.readouterr().err
    assert sorted(p.name for p in archive.parent.iterdir()) == [
        archive.name,
        archive.name + ".sha256",
    ]


def test_damaged_sdist_offline_is_named_with_the_fix(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = damaged_sdist(cache)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")
    with pytest.raises(PatchsetError) as caught:
        upstream.sdist(VERSION)
    message = str(caught.value)
    assert f"{archive} is damaged and could not be fetched again" in message
    assert "run the same command again" in message
    assert archive.read_bytes() == SDIST[:-1] + b"Z"  # not removed


def test_history_missing_a_release_is_built_again(
    cache: Path, index: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A history whose tag for a declared release is gone (a damaged or
    half-removed cache) is built again from the checked sdist."""
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.setattr(
        upstream, "release_order", lambda: [bases.Base(VERSION, "0", True)]
    )
    repo = upstream.release_history()
    assert (repo / "README").read_text() == f"vLLM {VERSION}\n"
    git("tag", "-d", f"v{VERSION}", cwd=repo)
    (repo / "README").unlink()
    assert upstream.release_history() == repo
    assert git("tag", cwd=repo).split() == [f"v{VERSION}"]
    assert (repo / "README").read_text() == f"vLLM {VERSION}\n"
    leftovers = sorted(p.name for p in repo.parent.iterdir())
    assert leftovers == [f".{repo.name}.lock", repo.name]


def test_damaged_cached_wheel_is_named_and_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from patchset_tool import wheel

    good = b"vLLM's own wheel"
    digest = hashlib.sha256(good).hexdigest()
    monkeypatch.setattr(wheel, "wheel_cache", lambda: tmp_path)
    monkeypatch.setattr(wheel, "index_sha256", lambda version: digest)
    fetched: list[str] = []

    def download(version: str, sha256: str, folder: Path) -> None:
        fetched.append(version)
        (folder / wheel.upstream_wheel_name(version)).write_bytes(good)

    monkeypatch.setattr(wheel, "_pip_download", download)
    cached = tmp_path / wheel.upstream_wheel_name(VERSION)
    cached.write_bytes(b"vLLM's own wheel, cut short")
    cached.with_name(cached.name + ".sha256").write_text(digest + "\n")

    got = wheel.upstream_wheel(VERSION)

    assert fetched == [VERSION]
    assert got.path.read_bytes() == good
    assert f"{cached}: damaged" in capsys.readouterr().err


def test_cut_sdist_without_its_record_is_fetched_again(
    cache: Path, index: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached sdist without its `.sha256` record is unverified: it is
    checked against the index's digest, and a cut-short one fetched again."""
    monkeypatch.setenv("PIP_INDEX_URL", index)
    archive = cache / "sdists" / f"vllm-{VERSION}.tar.gz"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(SDIST[: len(SDIST) // 2])
    assert upstream.sdist(VERSION) == archive
    assert archive.read_bytes() == SDIST
    recorded = archive.with_name(archive.name + ".sha256").read_text()
    assert recorded == hashlib.sha256(SDIST).hexdigest() + "\n"


def test_unrecorded_sdist_offline_is_named(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")
    archive = cache / "sdists" / f"vllm-{VERSION}.tar.gz"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(SDIST[:10])
    with pytest.raises(PatchsetError, match="without its sha256 record"):
        upstream.sdist(VERSION)


def test_cut_download_is_named_and_leaves_nothing(
    cache: Path, cut_index: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that closes mid-sdist is one error line, not a
    traceback, and the cache keeps no part of the download."""
    monkeypatch.setenv("PIP_INDEX_URL", cut_index)
    with pytest.raises(PatchsetError, match="could not download"):
        upstream.sdist(VERSION)
    assert list((cache / "sdists").iterdir()) == []


def test_interrupted_fetch_leaves_nothing(
    cache: Path, index: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after the download, before the sdist is checked and put in
    place, leaves no partial file behind."""
    monkeypatch.setenv("PIP_INDEX_URL", index)

    def interrupt(path: Path) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(upstream, "file_sha256", interrupt)
    with pytest.raises(KeyboardInterrupt):
        upstream.sdist(VERSION)
    assert list((cache / "sdists").iterdir()) == []
