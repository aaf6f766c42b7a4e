"""Every benchmark in bench/ still imports: they import one another and the project's helpers (scripts/stack.py,
the services), and nothing else runs them in the suite (they take minutes). bench/predict.py stopped at its first
line for sessions when a helper it imported moved. Each is imported in a fresh interpreter, as `python bench/X.py`
starts one; importing runs nothing but the module's top level (each script's work is under `__main__`)."""
import subprocess
import sys

import pytest

from scripts.stack import ROOT

SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))

IMPORT_ALL = """
import importlib, sys, traceback
sys.path.insert(0, "bench")
failed = 0
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        failed += 1
        print(f"bench/{name}.py:", traceback.format_exc(), file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_there_are_benchmarks_to_import():
    assert {"load", "round_latency", "api_profile", "predict"} <= set(SCRIPTS)


def test_every_benchmark_imports():
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, *SCRIPTS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        pytest.fail(done.stderr[-6000:])
