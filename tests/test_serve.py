"""muninn/serve.py: the site's web server (granian) listens from its first moment, before its workers have loaded
the application, so a request sent while it starts (a restart) waits and is answered instead of being refused."""
import os
import signal
import socket
import subprocess
import sys
import time

import requests

from scripts.stack import ROOT, free_port

# An application that takes as long to load as the site does on a slow machine (Django, torch: 4-8 s here).
SLOW_APP = '''
import os, time
time.sleep(float(os.environ["LOAD_SECONDS"]))

def application(environ, start_response):
    body = b"pid %d" % os.getpid()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
'''


def test_the_port_listens_before_the_workers_have_loaded_the_application(tmp_path):
    (tmp_path / "slow_app.py").write_text(SLOW_APP)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT / 'platform'}", "LOAD_SECONDS": "4"}
    server = subprocess.Popen(
        [sys.executable, "-m", "muninn.serve", "--interface", "wsgi", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "2", "--blocking-threads", "2", "--workers-kill-timeout", "2", "slow_app:application"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = time.monotonic()
        while True:  # listening well before the 4 s the workers take to load the application
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, server.stdout.read().decode(errors="replace")
                assert time.monotonic() - started < 3, "the port did not listen before the application loaded"
                time.sleep(0.05)
        # Sent now, while the workers are still loading: it waits in the backlog and is answered.
        answer = requests.get(f"http://127.0.0.1:{port}/", timeout=60)
        assert answer.status_code == 200 and answer.text.startswith("pid ")
        assert time.monotonic() - started >= 3.5  # it waited for a worker, as a request to a starting site does
        # Every worker takes connections from the one socket: new connections reach more than one of them.
        pids = {requests.get(f"http://127.0.0.1:{port}/", timeout=10, headers={"Connection": "close"}).text
                for _ in range(40)}
        assert len(pids) == 2, pids
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
