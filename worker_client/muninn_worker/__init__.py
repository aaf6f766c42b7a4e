"""Muninn worker client: claims work units, trains them locally and uploads the results.

Kept import-light on purpose (no torch here) so `muninn-worker --help` and flag errors answer at once.
"""

__version__ = "0.1.0"
