"""How a contributor installs the worker client: the one source of the commands that the contributor page shows and
README.md and worker_client/README.md repeat (tests/test_install_docs.py checks that they agree).

Until the site serves the client's wheel itself, it is installed from a checkout of the repository; torch's CPU
build goes first, or pip would pull the multi-GB CUDA build as the client's dependency."""

PYTHON = "3.11"  # what the client is tested on (worker_client/pyproject.toml's requires-python)
TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
CLIENT = "pip install ./worker_client"
UPGRADE = "pip install --upgrade ./worker_client"  # what a client too old for the site is told (contributors/versions.py)
RUN = "muninn-worker run"
