"""Muninn worker client: claims work units, trains them locally and uploads the results.

Kept import-light on purpose (no torch here) so `muninn-worker --help` and flag errors answer at once.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`from muninn_worker import load_model` (muninn_worker.package), imported only when asked for."""
    if name in ("load_model", "Model"):
        from . import package
        return getattr(package, name)
    raise AttributeError(f"module 'muninn_worker' has no attribute {name!r}")
