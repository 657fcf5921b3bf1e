# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's own source trees, from the releases' sdists, as one git history.

The wheel lacks `tests/`, `tools/` and `.buildkite/`; the sdist has them.
The cache holds a git repository whose commits are the sdists of the
declared bases in release order, each checked against the index's sha256
and tagged `v<version>`. On it the test command proves that each series
`git am -3`s onto the real tree and passes upstream's own pre-commit
gates, `rebase --onto` ports a series from one release to the next with a
three-way merge, and `worktree` gives a tree to edit.
"""

import contextlib
import html.parser
import http.client
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from . import gitutil, paths, trees
from .bases import Base, release_order
from .digests import file_sha256
from .errors import PatchsetError

SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
FIXED_DATE = "2000-01-01T00:00:00+00:00"


def index_url() -> str:
    """The package index pip is configured to use (PIP_INDEX_URL, pip's
    config files, else pip's own default), so no registry is named here."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].split()[0]
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True,
        text=True,
    )
    if configured.returncode == 0 and configured.stdout.strip():
        return configured.stdout.strip()
    default = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pip._internal.models.index import PyPI; print(PyPI.simple_url)",
        ],
        capture_output=True,
        text=True,
    )
    if default.returncode or not default.stdout.strip():
        raise PatchsetError(
            "cannot tell which package index to use: set PIP_INDEX_URL or "
            "`pip config set global.index-url URL`"
        )
    return default.stdout.strip()


class _Links(html.parser.HTMLParser):
    """The file links of a PEP 503 project page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.links.append(href)


def _sdist_link(version: str) -> tuple[str, str]:
    """(url, sha256) of vllm-<version>.tar.gz on the configured index."""
    project = urllib.parse.urljoin(index_url().rstrip("/") + "/", "vllm/")
    name = f"vllm-{version}.tar.gz"
    request = urllib.request.Request(
        project, headers={"Accept": f"{SIMPLE_JSON}, text/html;q=0.1"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        body = response.read().decode()
        kind = response.headers.get("Content-Type", "")
    if SIMPLE_JSON in kind:
        for entry in json.loads(body)["files"]:
            if entry["filename"] == name:
                url = urllib.parse.urljoin(project, entry["url"])
                return url, entry["hashes"]["sha256"]
    else:
        parser = _Links()
        parser.feed(body)
        for link in parser.links:
            url, _, fragment = urllib.parse.urljoin(project, link).partition("#")
            if url.endswith("/" + name) and fragment.startswith("sha256="):
                return url, fragment.removeprefix("sha256=")
    raise PatchsetError(
        f"{project} lists no {name} with a sha256: the index does not serve "
        "vLLM's sdist for this release; point pip at one that does "
        "(PIP_INDEX_URL)"
    )


def sdist(version: str) -> Path:
    """VLLM's sdist for `version`, downloaded once and sha256-checked, and
    checked again against the recorded sha256 on every use: a damaged
    copy is named and fetched again."""
    archive = _sdist_path(version)
    recorded = archive.with_name(archive.name + ".sha256")
    if not archive.is_file():
        return _fetch_sdist(version, archive, recorded)
    got = file_sha256(archive)
    try:
        want = recorded.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        # No record: unverified (kept by an older tool, or put there by
        # hand, or cut short). Only the index's digest can vouch for it.
        try:
            want = _sdist_link(version)[1]
        except OSError as exc:
            raise PatchsetError(
                f"{archive}: cached without its sha256 record, and the package "
                f"index cannot be reached to check it ({exc}); run again once "
                f"it can (or `rm {archive}`)"
            ) from exc
        if got == want:
            with contextlib.suppress(OSError):
                recorded.write_text(want + "\n", encoding="utf-8")
            return archive
    if got == want:
        return archive
    print(
        f"{archive}: damaged (sha256 {got[:16]}..., recorded or published "
        f"{want[:16]}...); fetching it again",
        file=sys.stderr,
        flush=True,
    )
    return _fetch_sdist(version, archive, recorded, damaged=True)


def sdist_is_cached(version: str) -> bool:
    """Whether `sdist(version)` can answer without the network."""
    return _sdist_path(version).is_file()


def _sdist_path(version: str) -> Path:
    """Where the release's sdist is cached."""
    return paths.cache_root() / "sdists" / f"vllm-{version}.tar.gz"


def release_files(version: str, names: list[str]) -> dict[str, bytes]:
    """The bytes of `names` (paths in vLLM's source tree) as the release's
    sha256-checked sdist holds them: the series' base files that the wheel
    does not ship (upstream's tests, docs)."""
    if not names:
        return {}
    found: dict[str, bytes] = {}
    with tarfile.open(sdist(version)) as tar:
        for member in tar:
            name = member.name.split("/", 1)[-1]
            if name in names and member.isfile():
                data = tar.extractfile(member)
                assert data is not None
                found[name] = data.read()
    missing = sorted(set(names) - set(found))
    if missing:
        raise PatchsetError(
            f"the series changes {', '.join(missing)}, which vLLM {version}'s "
            "sdist does not hold"
        )
    return found


def _fetch_sdist(
    version: str, archive: Path, recorded: Path, damaged: bool = False
) -> Path:
    """Download the sdist, check it against the index's sha256 and only
    then put it (and its digest) in place. The download goes to a file of
    its own beside the archive, removed on any failure or interrupt, so a
    cut-short or concurrent fetch never leaves or reads a partial one."""
    print(f"fetching the vllm=={version} sdist from the package index", flush=True)
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(
        prefix=archive.name + ".", suffix=".part", dir=archive.parent
    )
    partial = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                url, want = _sdist_link(version)
                with urllib.request.urlopen(url, timeout=600) as response:
                    shutil.copyfileobj(response, out)
                    if response.length:  # announced, never sent: cut short
                        raise http.client.IncompleteRead(b"", response.length)
            except (OSError, http.client.HTTPException) as exc:
                if damaged:
                    raise PatchsetError(
                        f"{archive} is damaged and could not be fetched again "
                        f"({exc}); run the same command again once the package "
                        f"index can be reached (or `rm {archive}` and copy "
                        "vLLM's own sdist there)"
                    ) from exc
                raise PatchsetError(
                    f"could not download vllm-{version}.tar.gz: {exc}; check the "
                    "network and pip's index configuration, then run again"
                ) from exc
        got = file_sha256(partial)
        if got != want:
            raise PatchsetError(
                f"vllm-{version}.tar.gz: sha256 {got} is not the index's {want}; "
                "nothing was kept"
            )
        partial.chmod(0o644)
        partial.replace(archive)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    recorded.write_text(want + "\n")
    return archive


def _commit_release(repo: Path, version: str) -> None:
    """Replace the tree of `repo` with the `version` sdist and tag it."""
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(sdist(version)) as tar:
            tar.extractall(tmp, filter="data")
        gitutil.git("rm", "-r", "--quiet", "--ignore-unmatch", ".", cwd=repo)
        for entry in (Path(tmp) / f"vllm-{version}").iterdir():
            shutil.move(str(entry), repo / entry.name)
    # --force: the sdist ships files its .gitignore names (vllm/_version.py)
    gitutil.git("add", "--all", "--force", cwd=repo)
    env = dict(os.environ, GIT_AUTHOR_DATE=FIXED_DATE, GIT_COMMITTER_DATE=FIXED_DATE)
    gitutil.git(
        *gitutil.IDENTITY,
        "commit",
        "--quiet",
        "-m",
        f"vLLM {version} sdist",
        cwd=repo,
        env=env,
    )
    gitutil.git("tag", f"v{version}", cwd=repo)


def release_history() -> Path:
    """The cached git history of the declared releases, oldest first, one
    commit per sdist, tagged `v<version>`; built once from the cached sdists
    for each set of declared bases, and built again when a tag is missing
    (a damaged or half-removed history)."""
    versions = [b.version for b in release_order()]
    # Keyed by the releases it holds, so that clones declaring other bases
    # (a branch adding one, say) keep their own history beside this one.
    repo = paths.cache_root() / "src" / ("vllm-history-" + "-".join(versions))
    if _has_releases(repo, versions):
        return repo
    with trees.locked(repo):
        if _has_releases(repo, versions):  # another run built it meanwhile
            return repo
        if repo.exists():
            print(f"{repo}: incomplete; building it again", file=sys.stderr)
        staging = repo.with_name(repo.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        gitutil.git("init", "--quiet", "-b", "releases", cwd=staging)
        for version in versions:
            _commit_release(staging, version)
        shutil.rmtree(repo, ignore_errors=True)
        staging.rename(repo)
    return repo


def _has_releases(repo: Path, versions: list[str]) -> bool:
    """Whether `repo` is a git repository whose tags name every release."""
    if not (repo / ".git").is_dir():
        return False
    tags = [f"v{v}^{{tree}}" for v in versions]
    found = gitutil.git("rev-parse", *tags, cwd=repo, check=False)
    return found.returncode == 0


def scratch_clone(into: Path, base: Base) -> Path:
    """A throw-away clone of the release history under `into`, checked out
    (detached) at `base`'s tag."""
    clone = into / "vllm"
    gitutil.git(
        "clone", "--quiet", "--shared", str(release_history()), str(clone), cwd=into
    )
    gitutil.git("checkout", "--quiet", "--detach", base.tag, cwd=clone)
    return clone
