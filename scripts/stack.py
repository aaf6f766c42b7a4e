"""Start and stop the platform's processes (web, Celery worker and beat, worker clients) as real processes.

Used by `make demo` and by the end-to-end tests, so both run the platform the same way.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
# The site's HTTP server, as docs/deploy.md runs it: granian (its HTTP in Rust, the WSGI application on each
# worker's threads; started by muninn/serve.py, which makes its port listen at once) cost the web 9.5-18 % less CPU
# per worker-API op than gunicorn's threaded worker under bench/load.py (docs/benchmarks.md, the eighteenth
# session). gunicorn stays runnable (`server="gunicorn"`), to compare: bench/load.py --server gunicorn.
WEB_SERVER = "granian"
WEB_SERVERS = ("granian", "gunicorn")
WEB_WORKER = "gthread"  # gunicorn's worker class, when gunicorn is the server
# A stopping worker answers its held long-poll claims at once (muninn/serve.py, jobs/wakeups.py); whatever it still
# serves after this long is cut (its clients send it again).
STOP_GRACE_S = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SecondHost:
    """Another machine on a network: a Linux network namespace with its own address (10.213.N.2), joined to this
    one (10.213.N.1) by a veth pair and reaching nothing else. Needs root (CAP_NET_ADMIN); `make()` answers None
    where the machine does not allow it."""

    def __init__(self, name: str, address: str, peer: str) -> None:
        self.name, self.address, self.peer = name, address, peer  # peer: this machine's address, as the host sees it

    @classmethod
    def make(cls) -> SecondHost | None:
        n = 1 + os.getpid() % 250
        name, outside, inside = f"muninn-host-{os.getpid()}", f"mnh{os.getpid()}", f"mnc{os.getpid()}"
        steps = [["ip", "netns", "add", name],
                 ["ip", "link", "add", outside, "type", "veth", "peer", "name", inside],
                 ["ip", "link", "set", inside, "netns", name],
                 ["ip", "addr", "add", f"10.213.{n}.1/30", "dev", outside],
                 ["ip", "link", "set", outside, "up"],
                 ["ip", "netns", "exec", name, "ip", "addr", "add", f"10.213.{n}.2/30", "dev", inside],
                 ["ip", "netns", "exec", name, "ip", "link", "set", inside, "up"],
                 ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"]]
        host = cls(name, f"10.213.{n}.2", f"10.213.{n}.1")
        for step in steps:
            try:
                done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                done = None
            if done is None or done.returncode != 0:
                host.remove()
                return None
        return host

    def command(self, argv: list[str]) -> list[str]:
        """argv run on that host."""
        return ["ip", "netns", "exec", self.name, *argv]

    def remove(self) -> None:  # the veth pair goes with the namespace
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", f"mnh{self.name.rsplit('-', 1)[1]}"], capture_output=True, timeout=30)


def base_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    # This checkout's worker client first, whatever an editable install elsewhere points at (as scripts/run.sh).
    env["PYTHONPATH"] = f"{ROOT / 'platform'}:{ROOT}:{ROOT / 'worker_client'}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


@dataclass
class Stack:
    """The processes one run started; `stop()` ends them all (also on errors, via the context manager)."""

    env: dict[str, str]
    log_dir: Path
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(args, cwd=ROOT, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def manage(self, *args: str, check: bool = True) -> str:
        out = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True,
                             text=True)
        if check and out.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def web(self, port: int, name: str = "web", env: dict[str, str] | None = None, *, workers: int = 2,
            threads: int = 16, host: str = "127.0.0.1", server: str = WEB_SERVER,
            worker_class: str = WEB_WORKER) -> str:
        """The site on `host:port`: `workers` processes of `threads` threads each (threads beyond the
        MUNINN_CLAIM_WAITERS, 8, long-poll claims a process may hold, for everything else)."""
        if server == "granian":
            args = [sys.executable, "-m", "muninn.serve", "--interface", "wsgi", "--host", host, "--port", str(port),
                    "--workers", str(workers), "--blocking-threads", str(threads),
                    "--workers-kill-timeout", str(STOP_GRACE_S), "--respawn-failed-workers",
                    "--respawn-interval", "0.5", "muninn.wsgi:application"]
        elif server == "gunicorn":
            args = [str(VENV_BIN / "gunicorn"), "muninn.wsgi:application", "--bind", f"{host}:{port}",
                    "--workers", str(workers), "--threads", str(threads), "--timeout", "120",
                    "--worker-class", worker_class]
        else:
            raise ValueError(f"unknown web server {server!r}: one of {', '.join(WEB_SERVERS)}")
        self.spawn(name, args, env)
        url = f"http://{host}:{port}"
        wait_http(f"{url}/healthz")
        return url

    def celery_worker(self, name: str = "celery-worker", env: dict[str, str] | None = None, *,
                      queues: str = "celery,validation") -> subprocess.Popen:
        return self.spawn(name, [str(VENV_BIN / "celery"), "-A", "muninn", "worker", "--loglevel=INFO",
                                 "--concurrency=1", "--pool=solo", "--without-mingle", "--without-gossip",
                                 "--hostname", f"{name}@%h", "--queues", queues], env)

    def celery_beat(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.spawn("celery-beat", [str(VENV_BIN / "celery"), "-A", "muninn", "beat", "--loglevel=INFO",
                                          "--schedule", str(self.log_dir / "celerybeat-schedule")], env)

    def register_device(self, server: str, account_token: str, name: str) -> Path:
        config = self.log_dir / f"{name}.json"
        out = subprocess.run([str(VENV_BIN / "muninn-worker"), "register", "--server", server, "--token",
                              account_token, "--name", name, "--config", str(config)],
                             env=self.env, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"muninn-worker register failed:\n{out.stdout}\n{out.stderr}")
        return config

    def worker_client(self, name: str, config: Path, *extra: str, env: dict[str, str] | None = None
                      ) -> subprocess.Popen:
        return self.spawn(name, [str(VENV_BIN / "muninn-worker"), "run", "--config", str(config),
                                 "--cache-dir", str(self.log_dir / f"{name}-cache"), *extra], env)

    def stop(self, name: str | None = None, sig: int = signal.SIGTERM) -> None:
        chosen = [proc for proc_name, proc in self.procs if name is None or proc_name == name]
        for proc in chosen:  # signal them all first, so that they shut down side by side
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        for proc in chosen:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def wait_for_log(self, name: str, text: str, timeout: float = 90.0) -> None:
        """Until the process's log shows `text` (e.g. a failpoint's "failpoint NAME reached")."""
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not log {text!r} within {timeout:.0f}s:\n{self.log(name)[-3000:]}")
            time.sleep(0.1)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> Stack:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def ok(response: requests.Response) -> dict:
    """The JSON of a 2xx answer; anything else ends the script, naming the request and the site's answer."""
    if not response.ok:
        raise SystemExit(f"{response.request.method} {response.url} -> {response.status_code}: {response.text}")
    return response.json()


ENDED = ("succeeded", "failed", "cancelled")


def watch_job(api: requests.Session, url: str, job_id: int, *, started: float, timeout: float,
              every: float = 0.3) -> dict:
    """Poll the job, printing each round as it closes (its test accuracy and units, seconds since `started`),
    until it has ended or `timeout` seconds have passed since `started`. Returns the job as last read: the caller
    tells a timeout by its status not being in ENDED."""
    seen = 0
    while True:
        job = ok(api.get(f"{url}/api/jobs/{job_id}"))
        for rnd in job["round_list"][seen:]:
            if rnd["status"] != "closed":
                break
            print(f"round {rnd['number']:2d}: test accuracy {rnd['metrics'].get('test_accuracy', float('nan')):.4f} "
                  f"({rnd['metrics'].get('units')} unit(s)), {time.monotonic() - started:.0f}s", flush=True)
            seen += 1
        if job["status"] in ENDED or time.monotonic() - started > timeout:
            return job
        time.sleep(every)


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")
