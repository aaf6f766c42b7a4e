"""How a contributor installs the worker client: the one source of the commands that the contributor page shows and
README.md and worker_client/README.md repeat (tests/test_install_docs.py checks that they agree, and
tests/test_fresh_install.py runs the page's commands in a fresh virtualenv).

The site serves the client's wheel itself (contributors/wheel.py, /downloads/<wheel>), so a machine needs nothing
but Python: torch first (the CPU build, or the CUDA build where `nvidia-smi` exists; otherwise pip would pull the
multi-GB CUDA build as the client's dependency), then the client from the site."""
from __future__ import annotations

from . import wheel

PYTHON = "3.11"  # what the client is tested on (worker_client/pyproject.toml's requires-python)
TORCH_VERSION = "2.13.0"
TORCH_CPU = f"pip install torch=={TORCH_VERSION} --index-url https://download.pytorch.org/whl/cpu"
TORCH_CUDA = f"pip install torch=={TORCH_VERSION}"
TORCH = f"if command -v nvidia-smi >/dev/null; then {TORCH_CUDA}; else {TORCH_CPU}; fi"
RUN = "muninn-worker run"
SERVER = "http://HOST:8000"  # how the docs write the site's address (the page writes the real one)


def client(server: str = SERVER) -> str:
    return f"pip install {server.rstrip('/')}/downloads/{wheel.wheel_name()}"


def upgrade(server: str = SERVER) -> str:
    """What a client too old for the site is told (contributors/versions.py)."""
    return f"pip install --upgrade {server.rstrip('/')}/downloads/{wheel.wheel_name()}"


def commands(server: str = SERVER) -> list[str]:
    """The install commands, in order, as the page shows them (one per line)."""
    return [TORCH, client(server)]
