"""platform/ holds the Django project but must never shadow the standard library's `platform` module."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("pythonpath", ["", f"{ROOT / 'platform'}:{ROOT}"])
def test_standard_library_platform_still_imports_from_the_repository_root(pythonpath):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", "import platform; print(platform.system(), platform.__file__)"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    system, path = out.stdout.split()
    assert system == "Linux"
    assert not path.startswith(str(ROOT))


def test_every_celery_process_warms_torch_up_when_it_starts():
    from celery.signals import worker_process_init

    from muninn import celery

    assert any(receiver() is celery._on_process_start for _, receiver in worker_process_init.receivers)


def test_a_web_process_freezes_its_start_up_heap():
    """muninn/wsgi.py, what the web server loads: start-up's objects (Django, torch) leave the collector's full passes
    (muninn_worker.heap). In a subprocess: it freezes the process that imports it."""
    import os

    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}:{ROOT / 'worker_client'}", "DEBUG": "1",
           "DJANGO_SETTINGS_MODULE": "muninn.settings"}
    out = subprocess.run([sys.executable, "-c", "import gc, muninn.wsgi; print(gc.get_freeze_count())"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > 100_000  # Django and torch's objects: ~250,000


def test_a_web_process_pays_its_first_use_costs_when_it_starts():
    """muninn/wsgi.py makes the Redis wake-up carrier (jobs.wakeups) and counts FLOPs once at start-up, so neither
    the first waiting claim (importing redis) nor a customer's first quote (torch._dynamo, ~1.1 s) pays them under
    the GIL beside busy threads. In a subprocess, as the web server loads it."""
    import os

    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}:{ROOT / 'worker_client'}", "DEBUG": "1",
           "DJANGO_SETTINGS_MODULE": "muninn.settings", "MUNINN_WAKEUP_REDIS_URL": "redis://127.0.0.1:6379/9"}
    code = ("import sys, muninn.wsgi; from jobs import wakeups; print('torch._dynamo' in sys.modules); "
            "print(sorted(k[0] for k in wakeups._carriers))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-3:-1] == ["True", "['redis']"]
