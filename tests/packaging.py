"""Build kvtrace's wheel and sdist from a clean copy of the source tree.

    from tests.packaging import build_dist
    wheel, sdist = build_dist(workdir)    # two pathlib.Paths under workdir (a fresh directory)

In pytest, take the session fixture ``built_dist`` (tests/conftest.py): the same pair, built
once per session.

The copy holds exactly the files ``git ls-files -co --exclude-standard`` lists, so uncommitted
edits and new files count while build/, *.egg-info, .venv and other ignored files do not: what is
tested is what a clean checkout builds.  ``python -m build`` (the ``build`` package, in the
``test`` extra) builds the sdist, then the wheel from that sdist; its isolated build environment
fetches setuptools from PyPI.  ``copy_tree`` and ``build`` are separate so a test (or a person)
can edit the copy before building it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def source_files(repo: Path = REPO) -> list[str]:
    """The tree's files relative to ``repo``: tracked or untracked, not ignored, not deleted."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo,
                         capture_output=True, check=True).stdout.decode()
    return sorted(f for f in out.split("\0") if f and (repo / f).is_file())


def copy_tree(dest: Path, repo: Path = REPO) -> Path:
    """Copy ``source_files(repo)`` into ``dest`` (created); returns ``dest``."""
    for rel in source_files(repo):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target)
    return dest


def build(src: Path, out: Path) -> tuple[Path, Path]:
    """Build ``src`` into ``out``: (wheel, sdist).  Raises with the build's output on failure."""
    r = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(src)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"python -m build failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, f"expected one wheel and one sdist in {out}: {wheels + sdists}"
    return wheels[0], sdists[0]


def build_dist(workdir: Path, repo: Path = REPO) -> tuple[Path, Path]:
    """A clean copy of ``repo`` in ``workdir/src``, built into ``workdir/dist``: (wheel, sdist)."""
    return build(copy_tree(workdir / "src", repo), workdir / "dist")


def install_wheel(wheel: Path, venv: Path) -> Path:
    """A new venv at ``venv`` (Debian's Python, seeing Debian's bcc) with ``wheel`` installed."""
    for cmd in (["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
                [str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check", str(wheel)]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd="/")
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])}… failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return venv
