# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`ZipCopier`, which writes the wheel: members copied still compressed read
back as the source's, new members deflate, and an archive past classic zip's
limits is refused. (The wheel tests install what it writes with uv.)"""

import io
import zipfile
from pathlib import Path

import pytest

from patchset_tool import zipcopy
from patchset_tool.errors import PatchsetError
from patchset_tool.zipcopy import ZipCopier

MEMBERS = {
    "vllm/stored.txt": (b"kept as is\n", zipfile.ZIP_STORED),
    "vllm/deflated.so": (bytes(range(256)) * 512, zipfile.ZIP_DEFLATED),
    "vllm/ünïcode.py": (b"# name in UTF-8\n", zipfile.ZIP_DEFLATED),
}


def source_archive(path: Path) -> Path:
    """An archive with stored, deflated and streamed (data descriptor)
    members, one of them executable."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, (data, method) in MEMBERS.items():
            info = zipfile.ZipInfo(name, (2026, 1, 2, 3, 4, 6))
            info.compress_type = method
            info.external_attr = 0o100755 << 16
            archive.writestr(info, data)
    unseekable = io.BytesIO()
    with (
        zipfile.ZipFile(_Unseekable(unseekable), "w") as archive,
        archive.open("vllm/streamed.bin", "w") as member,
    ):
        member.write(b"streamed " * 1000)
    (path.parent / "streamed.zip").write_bytes(unseekable.getvalue())
    return path


class _Unseekable(io.RawIOBase):
    """Makes zipfile write a data descriptor after the member."""

    def __init__(self, inner: io.BytesIO) -> None:
        self.inner = inner

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        return self.inner.write(data)

    def flush(self) -> None:
        pass


def test_copied_members_read_back_unchanged(tmp_path: Path) -> None:
    source = source_archive(tmp_path / "source.zip")
    target = tmp_path / "target.zip"
    with zipfile.ZipFile(tmp_path / "streamed.zip") as zf:
        assert zf.getinfo("vllm/streamed.bin").flag_bits & 0x08  # a descriptor
    with open(target, "wb") as out:
        copier = ZipCopier(out)
        for archive_path in (source, tmp_path / "streamed.zip"):
            with zipfile.ZipFile(archive_path) as zf, open(archive_path, "rb") as raw:
                for info in zf.infolist():
                    copier.copy(raw, info, "renamed/" + info.filename)
        new = zipfile.ZipInfo("vllm/new.py", (2026, 1, 2, 3, 4, 6))
        new.external_attr = 0o100644 << 16
        copier.add(new, b"ANSWER = 42\n")
        copier.close()
    with zipfile.ZipFile(target) as zf:
        assert zf.testzip() is None
        for name, (data, method) in MEMBERS.items():
            info = zf.getinfo("renamed/" + name)
            assert zf.read(info) == data
            assert info.compress_type == method
            assert info.external_attr >> 16 == 0o100755
            assert info.date_time == (2026, 1, 2, 3, 4, 6)
        assert zf.read("renamed/vllm/streamed.bin") == b"streamed " * 1000
        assert not zf.getinfo("renamed/vllm/streamed.bin").flag_bits & 0x08
        assert zf.read("vllm/new.py") == b"ANSWER = 42\n"
        assert zf.getinfo("vllm/new.py").compress_type == zipfile.ZIP_DEFLATED


def test_archive_that_needs_zip64_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zipcopy, "LIMIT", 100)
    with open(tmp_path / "big.zip", "wb") as out:
        copier = ZipCopier(out)
        with pytest.raises(PatchsetError, match="would need zip64"):
            copier.add(zipfile.ZipInfo("vllm/big.bin"), bytes(1000))
