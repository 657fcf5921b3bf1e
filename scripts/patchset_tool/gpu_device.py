# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs on the GPU machine: unpacks `gpu --engine`'s parts and runs vLLM there.

Standard library only; travels in every part as `engine.py`. Everything goes
under `ENGINE_ROOT` (/tmp/glm5engine), which lives only while the machine stays
warm:

    python3 PART/engine.py unpack        # one call per part, in any order
    python3 PART/engine.py tests [ARGS]  # upstream's glm5next step, both trees
    python3 PART/engine.py run TREE -- CMD...   # any command on one tree

The other verbs first check that every part of `MANIFEST.json` was unpacked.
Each record carries the stage's manifest (vLLM version, series, parts): the
first part of another stage unpacked on the same machine removes the first
stage's files, so that no stage runs on another's trees.
"""

import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ENGINE_ROOT = Path(os.environ.get("GLM5ENGINE_ROOT", "/tmp/glm5engine"))
TREES = ("pristine", "patched")
PYTEST_STEP = ["-v", "-s", "models/glm5next"]
"""Upstream's glm5next-unit-tests step, run from `tests/`."""

SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
}


def fail(message: str) -> None:
    print(f"engine: {message}", file=sys.stderr)
    raise SystemExit(2)


def stage_of(part: Path) -> str:
    """What identifies the stage `part` belongs to, from its manifest."""
    path = part / "MANIFEST.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    return json.dumps({k: manifest.get(k) for k in ("vllm", "series", "parts")})


def unpack(part: Path, root: Path) -> None:
    """Extract `part` into `root` and record it in `root/.parts/`; the
    files of another stage unpacked there before are removed first."""
    started = time.time()
    stage = stage_of(part)
    record = root / ".stage"
    if (root / ".parts").is_dir() and (
        not record.is_file() or record.read_text() != stage
    ):
        print(f"engine: {root} holds another stage's files; removing them")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    record.write_text(stage)
    for item in sorted(part.iterdir()):
        src = join(item, root) if item.name.endswith(".split") else item
        if src is not None:
            unpack_file(src, root)
    (root / ".parts").mkdir(parents=True, exist_ok=True)
    (root / ".parts" / part.name).write_text(stage)
    print(f"engine: unpacked {part.name} into {root} ({time.time() - started:.0f} s)")


def join(piece: Path, root: Path) -> Path | None:
    """Keep `piece` (`NAME.I-of-N.split`); once all N are kept, the joined
    `NAME`, else None."""
    name, _, count = piece.name[: -len(".split")].rpartition(".")
    total = int(count.split("-of-")[1])
    pieces = root / "pieces"
    pieces.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(piece, pieces / piece.name)
    found = [pieces / f"{name}.{i}-of-{total}.split" for i in range(1, total + 1)]
    if not all(p.exists() for p in found):
        return None
    joined = root / "joined" / name
    joined.parent.mkdir(parents=True, exist_ok=True)
    with open(joined, "wb") as out:
        for p in found:
            out.write(p.read_bytes())
            p.unlink()
    return joined


def unpack_file(src: Path, root: Path) -> None:
    """Extract one file of a part into `root`."""
    name = src.name
    if name.startswith("ext-") and name.endswith(".xz"):
        rel = name[len("ext-") : -len(".xz")].replace("+", "/")
        out = root / "ext" / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(lzma.decompress(src.read_bytes()))
        out.chmod(0o755)
    elif name.endswith(".tar.xz"):
        dest = root / name[: -len(".tar.xz")]
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        with tarfile.open(src) as tar:
            tar.extractall(dest, filter="tar")
    elif name.endswith(".whl"):
        (root / "wheels").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / "wheels" / name)


def _link_tree(src: Path, dest: Path) -> None:
    """`dest` as a copy of `src` made of hard links (symlinks for folders
    would let the patched files leak into the pristine tree)."""
    shutil.copytree(src, dest, copy_function=os.link)


def prepare(part: Path, root: Path) -> dict:
    """Check every part is unpacked; install the wheels; build both trees."""
    manifest = json.loads((part / "MANIFEST.json").read_text())
    stage = stage_of(part)
    records = [root / ".parts" / p for p in manifest["parts"]]
    missing = [r.name for r in records if not r.is_file() or r.read_text() != stage]
    if missing:
        fail(
            f"part(s) {', '.join(missing)} not unpacked in {root} (the machine "
            "went cold between calls?): run every part's `unpack` again"
        )
    ready = root / ".ready"
    if not ready.is_file() or ready.read_text() != stage:
        wheels = sorted((root / "wheels").glob("*.whl"))
        if wheels:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-index",
                 "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                 "--target", str(root / "site"), *map(str, wheels)],
                check=False,
            )  # fmt: skip
            if done.returncode:
                fail(f"pip could not install the wheels (exit {done.returncode})")
        for tree in TREES:
            shutil.rmtree(root / f"tree-{tree}", ignore_errors=True)
        _link_tree(root / "vllm-py", root / "tree-pristine")
        _link_tree(root / "vllm-py", root / "tree-patched")
        for src in sorted((root / "vllm-patched").rglob("*")):
            if src.is_file():
                dest = root / "tree-patched" / src.relative_to(root / "vllm-patched")
                dest.parent.mkdir(parents=True, exist_ok=True)
                if dest.exists():
                    dest.unlink()
                shutil.copyfile(src, dest)
        for tree in TREES:
            for so in sorted((root / "ext").rglob("*.so")):
                dest = root / f"tree-{tree}" / so.relative_to(root / "ext")
                dest.parent.mkdir(parents=True, exist_ok=True)
                if not dest.exists():
                    dest.symlink_to(so)
            extra = root / "flashinfer"
            if extra.is_dir():
                for entry in sorted(extra.iterdir()):
                    dest = root / f"tree-{tree}" / entry.name
                    if not dest.exists():
                        dest.symlink_to(entry)
        ready.write_text(stage)
    return manifest


def tree_env(root: Path, tree: str) -> dict[str, str]:
    env = dict(os.environ, **SAFE_ENV)
    site = root / "site"
    # `--target` installs skip .pth files: nvidia-cutlass-dsl's puts this
    # folder (the `cutlass` package) on the path.
    paths = [root / f"tree-{tree}", site, site / "nvidia_cutlass_dsl/dsl_packages"]
    env["PYTHONPATH"] = os.pathsep.join(map(str, paths))
    env["VLLM_CACHE_ROOT"] = str(root / f"cache-{tree}")
    env["FLASHINFER_WORKSPACE_BASE"] = str(root / f"fiws-{tree}")
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    # The stage's FlashInfer is its SM90 MLA modules alone: no sampler.
    env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


VERSIONS = (
    "import sys,torch,triton;print(sys.version.split()[0],"
    "torch.__version__,torch.version.cuda,triton.__version__)"
)


def device_info(out: Path) -> None:
    with open(out / "device.txt", "w") as f:
        if not shutil.which("nvidia-smi"):
            f.write("no nvidia-smi on this machine\n")
            f.flush()
        else:
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                 "--format=csv,noheader"],
                stdout=f, stderr=subprocess.STDOUT, check=False,
            )  # fmt: skip
        subprocess.run(
            [sys.executable, "-c",
             VERSIONS],
            stdout=f, stderr=subprocess.STDOUT, check=False,
        )  # fmt: skip


def run_tests(root: Path, out: Path, extra: list[str], timeout_s: int) -> int:
    """Upstream's step on each tree; junit XML and logs into `out`."""
    summary = {}
    worst = 0
    for tree in TREES:
        started = time.time()
        cmd = [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
            *PYTEST_STEP, "-rA", f"--junitxml={out / f'junit-{tree}.xml'}",
            *extra,
        ]  # fmt: skip
        with open(out / f"pytest-{tree}.log", "w") as log:
            try:
                done = subprocess.run(
                    cmd, cwd=root / "src" / "tests", env=tree_env(root, tree),
                    stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                )  # fmt: skip
                rc = done.returncode
            except subprocess.TimeoutExpired:
                rc = 124
        summary[tree] = {"rc": rc, "seconds": round(time.time() - started, 1)}
        print(f"engine: {tree}: pytest exit {rc} in {summary[tree]['seconds']} s")
        tail = (out / f"pytest-{tree}.log").read_text(errors="replace")
        print("\n".join(tail.splitlines()[-3:]))
        worst = max(worst, 0 if rc in (0, 1) else rc)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return worst


def main(argv: list[str]) -> int:
    part = Path(__file__).resolve().parent
    if not argv or argv[0] not in ("unpack", "tests", "run"):
        fail("usage: engine.py unpack | tests [PYTEST_ARG...] | run TREE -- CMD...")
    verb, rest = argv[0], argv[1:]
    if verb == "unpack":
        unpack(part, ENGINE_ROOT)
        return 0
    out = Path(os.environ.get("OUT", "/tmp/glm5engine-out"))
    out.mkdir(parents=True, exist_ok=True)
    prepare(part, ENGINE_ROOT)
    device_info(out)
    if verb == "tests":
        timeout_s = int(os.environ.get("GLM5ENGINE_TEST_TIMEOUT", "240"))
        return run_tests(ENGINE_ROOT, out, rest, timeout_s)
    if len(rest) < 3 or rest[0] not in TREES or rest[1] != "--":
        fail("usage: engine.py run pristine|patched -- CMD...")
    env = tree_env(ENGINE_ROOT, rest[0])
    return subprocess.run(rest[2:], env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
