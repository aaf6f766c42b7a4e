"""A contributor's machine with nothing but Python: a fresh virtualenv in a fresh folder, the contributor page's
install commands run literally (torch first, then the client's wheel from the site itself), the page's register
command, and the installed client trains a unit of a real job over HTTP (the web server, a Celery worker).

Where the machine allows it (root: a network namespace), that machine is a second network host with its own
address (scripts/stack.py SecondHost): the site listens only on this host's side of the link, so every byte of
the install and the training crosses the network; elsewhere it is this host over loopback."""
from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from django.utils import timezone

from contributors.models import Receipt
from scripts.stack import SecondHost, free_port

from .conftest import digits_npz
from .test_e2e import customer_session, market, stack, wait_until_ended  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def page_commands(url: str, username: str, password: str) -> dict[str, str]:
    """The commands the contributor page shows, as a person copies them (logged in through the login form)."""
    browser = requests.Session()
    browser.get(f"{url}/login/")
    answer = browser.post(f"{url}/login/", data={"username": username, "password": password,
                                                 "csrfmiddlewaretoken": browser.cookies["csrftoken"]},
                          headers={"Referer": f"{url}/login/"})
    assert answer.ok and answer.url.endswith("/contribute/"), answer.url
    page = browser.get(f"{url}/contribute/").text
    return {name: html.unescape(re.search(rf'<pre class="command" id="{name}-command">(.*?)</pre>', page, re.S)[1])
            for name in ("install", "register", "run")}


@pytest.fixture
def second_host():
    host = SecondHost.make()
    if host is None:
        print("no network namespace here (needs root): the contributor's machine is this one, over loopback")
    yield host
    if host is not None:
        host.remove()


def test_the_contributor_pages_commands_install_and_run_the_client_in_a_fresh_virtualenv(
        stack, market, second_host, tmp_path):  # noqa: F811
    customer, contributor = market
    url = stack.web(free_port(), host=second_host.peer if second_host else "127.0.0.1")
    stack.celery_worker()
    commands = page_commands(url, "dave", "dave-pass-123")
    machine = tmp_path / "machine"  # the contributor's home: nothing of this repository in reach
    machine.mkdir()
    user_pip = Path.home() / ".config" / "pip" / "pip.conf"  # where this machine's pip finds packages (no internet)
    if user_pip.is_file():
        (machine / ".config" / "pip").mkdir(parents=True)
        shutil.copy(user_pip, machine / ".config" / "pip" / "pip.conf")
    subprocess.run([sys.executable, "-m", "venv", str(machine / "venv")], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "DJANGO", "MUNINN"))}
    env.update(HOME=str(machine), VIRTUAL_ENV=str(machine / "venv"),
               PATH=f"{machine / 'venv' / 'bin'}:{os.environ['PATH']}",
               # no internet here: pip's retries of the unreachable PyTorch index are cut short (torch itself comes
               # from this machine's local wheels, as pip is configured to look there too)
               PIP_RETRIES="0", PIP_DEFAULT_TIMEOUT="5")
    on_machine = second_host.command if second_host else (lambda argv: argv)
    shell = lambda command, timeout=600: subprocess.run(  # noqa: E731
        on_machine(["bash", "-c", command]), cwd=machine, env=env, capture_output=True, text=True, timeout=timeout)
    if second_host:  # the commands name the site by the address the contributor reached it at, not loopback
        assert url in commands["register"] and url in commands["install"], commands
        port = url.rsplit(":", 1)[1]  # and nothing of the site is on that machine's own loopback
        assert shell(f"curl -sf --max-time 3 http://127.0.0.1:{port}/healthz").returncode != 0

    # The site builds the wheel it serves on the first request for it (or at release: manage.py build_worker_wheel).
    # Built here first, as a release would, so the contributor's pip, whose timeout is cut to 5 s above, never waits
    # on that build: on a loaded machine it took longer, and pip gave up on the download.
    wheel_url = re.search(r"(https?://\S+\.whl)", commands["install"])[1]
    assert requests.get(wheel_url, timeout=300).status_code == 200
    for line in commands["install"].splitlines():  # literally, line by line
        done = shell(line)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    where = shell("python -c 'import muninn_worker, torch; print(muninn_worker.__file__, torch.__version__)'")
    assert str(machine / "venv") in where.stdout and "+cpu" in where.stdout, where.stdout + where.stderr
    registered = shell(commands["register"], timeout=120)
    assert registered.returncode == 0, registered.stderr

    api = customer_session(customer)
    dataset = api.post(f"{url}/api/datasets", files={"file": ("digits.npz", digits_npz())}).json()
    started = timezone.now()
    job = api.post(f"{url}/api/jobs", json={"dataset": dataset["id"], "template": "mlp", "rounds": 1, "seed": 3,
                                            "start": True}).json()
    worked = shell(f"{commands['run']} --max-units 1 --exit-when-idle 60", timeout=300)
    job = wait_until_ended(api, url, job)

    assert worked.returncode == 0, worked.stderr[-3000:]
    assert job["status"] == "succeeded", stack.log("web")[-3000:]
    receipt = Receipt.objects.get(unit__round__job_id=job["id"], status=Receipt.Status.ACCEPTED)
    assert receipt.device.name == "dave-laptop" and receipt.created_at > started
