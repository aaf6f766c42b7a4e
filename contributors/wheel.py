"""The worker client's wheel, served by the site itself at /downloads/<wheel file>: a contributor's machine installs
the client from the site with nothing but Python (and torch first), no checkout of the repository.

Built from this site's own `worker_client/` (so the client it hands out always speaks the site's protocol) with
`pip wheel`, the first time it is asked for or ahead of time by `manage.py build_worker_wheel` (at release), and
kept under MUNINN_VAR_DIR/wheels by version and a hash of the client's sources: a changed client is built again
even when its version string was not bumped. MUNINN_WORKER_WHEEL names a wheel built elsewhere instead.
"""
from __future__ import annotations

import fcntl
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

from django.conf import settings

SOURCE = Path(settings.BASE_DIR) / "worker_client"


class WheelUnavailable(Exception):
    """The wheel could not be built (no worker_client/ beside the site, or pip failed): the message says why."""


@lru_cache(maxsize=1)
def version() -> str:
    """The client's version, read from its sources (not from whatever muninn_worker this process imported)."""
    text = (SOURCE / "muninn_worker" / "__init__.py").read_text()
    found = re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if found is None:
        raise WheelUnavailable("worker_client/muninn_worker/__init__.py declares no __version__")
    return found.group(1)


def wheel_name() -> str:
    if settings.MUNINN_WORKER_WHEEL:
        return Path(settings.MUNINN_WORKER_WHEEL).name
    return f"muninn_worker-{version()}-py3-none-any.whl"


def wheel_path() -> Path:
    """The wheel's file, built first if this version of the sources has none yet (one build at a time, whatever
    the number of processes asking)."""
    if settings.MUNINN_WORKER_WHEEL:
        return Path(settings.MUNINN_WORKER_WHEEL)
    folder = Path(settings.VAR_DIR) / "wheels" / f"{version()}-{_sources_hash()}"
    built = folder / wheel_name()
    if built.is_file():
        return built
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.is_file():
            _build(built)
    return built


def _build(target: Path) -> None:
    if not (SOURCE / "pyproject.toml").is_file():
        raise WheelUnavailable(f"no worker client sources at {SOURCE}: set MUNINN_WORKER_WHEEL to a built wheel")
    with tempfile.TemporaryDirectory(prefix="muninn-wheel-") as tmp:
        # a copy: pip's build must not leave build/ or *.egg-info in the site's checkout
        source = shutil.copytree(SOURCE, Path(tmp) / "src", ignore=shutil.ignore_patterns(
            "build", "*.egg-info", "__pycache__", "tests"))
        out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                              "--wheel-dir", str(Path(tmp) / "dist"), str(source)],
                             capture_output=True, text=True, timeout=300)
        made = Path(tmp) / "dist" / target.name
        if out.returncode != 0 or not made.is_file():
            raise WheelUnavailable(f"building the worker client's wheel failed: {(out.stderr or out.stdout)[-500:]}")
        shutil.move(made, target.with_suffix(".tmp"))
        target.with_suffix(".tmp").replace(target)  # whole or not at all


@lru_cache(maxsize=1)
def _sources_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted([SOURCE / "pyproject.toml", *(SOURCE / "muninn_worker").rglob("*")]):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(SOURCE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]
