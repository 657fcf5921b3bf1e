# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The digests the tool compares: a file's sha256, RECORD's form of it,
and git's blob id."""

import base64
import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _record_form(sha256: bytes) -> str:
    """RECORD's form of a sha256 digest: urlsafe base64 without padding."""
    return "sha256=" + base64.urlsafe_b64encode(sha256).rstrip(b"=").decode()


def record_hash(data: bytes) -> str:
    """The sha256 of `data` in RECORD's form (`sha256=...`)."""
    return _record_form(hashlib.sha256(data).digest())


def record_digest(path: Path) -> str:
    """A file's sha256 in RECORD's form, read in chunks."""
    with open(path, "rb") as handle:
        return _record_form(hashlib.file_digest(handle, "sha256").digest())


def git_blob_id(data: bytes) -> str:
    """The id git gives a blob holding `data`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
