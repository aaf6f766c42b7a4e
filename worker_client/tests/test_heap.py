"""muninn_worker.heap: what start-up left as garbage is collected, then what is alive leaves the collector's full
passes; what comes later is collected as ever. In a subprocess: freezing pytest's own heap would outlive the test."""
import subprocess
import sys

SCRIPT = """
import gc, weakref
from muninn_worker import heap

class Node:
    pass

kept = Node()
cycle = Node()
cycle.me = cycle  # garbage only a collection finds
gone = weakref.ref(cycle)
del cycle
frozen = heap.freeze()
assert gone() is None, "start-up's garbage is collected before the freeze"
assert frozen == gc.get_freeze_count() > 1000, frozen
assert not any(o is kept for o in gc.get_objects()), "alive at the freeze: in no generation a pass walks"
later = Node()
assert any(o is later for o in gc.get_objects()), "made after: collected as ever"
print("frozen", frozen)
"""


def test_freeze_collects_start_up_garbage_then_exempts_what_is_alive():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)

    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("frozen ")


def test_the_worker_command_freezes_its_process_heap_and_a_caller_of_run_does_not(tmp_path, monkeypatch):
    """`muninn-worker run` owns its process, so it asks run() to freeze once torch is warm; run() called from
    someone else's process (a test, an embedding program) leaves that process's collector alone by default."""
    import inspect
    import json
    import signal

    from muninn_worker import cli, runner
    from muninn_worker.signing import new_private_key

    assert inspect.signature(runner.run).parameters["freeze_heap"].default is False
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"server": "http://127.0.0.1:9", "device_token": "t", "signing_key": new_private_key()}))
    calls = []
    monkeypatch.setattr(runner, "run", lambda client, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the command's SIGTERM handler, not for pytest

    assert cli.main(["run", "--config", str(config), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert [call["freeze_heap"] for call in calls] == [True]
