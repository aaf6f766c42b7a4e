"""The site's gunicorn worker (muninn.web_worker): real gunicorn processes serving a tiny WSGI app over real sockets.

Each test pins what gthread, whose code the worker reuses, already promised: keep-alive and pipelined requests,
threads that serve requests at once, idle connections closed, a graceful stop, restarts after max_requests; and one
thing the worker's own design could break: a request that waited for a thread past its connection's keep-alive
timeout is answered, not reset."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from scripts.stack import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not hasattr(__import__("select"), "epoll"), reason="the worker needs Linux's epoll")

APP = '''
import os, threading, time

together = threading.Barrier(4, timeout=30)


def application(environ, start_response):
    path = environ["PATH_INFO"]
    body = environ["wsgi.input"].read()
    if path == "/together":  # answered only when four requests are in the app at once
        together.wait()
    elif path == "/slow":
        time.sleep(float(environ["QUERY_STRING"]))
    out = f"{path} {len(body)} {os.getpid()}".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(out)))])
    return [out]
'''


class Server:
    def __init__(self, tmp_path: Path, *args: str) -> None:
        (tmp_path / "tiny_app.py").write_text(APP)
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "platform"), str(ROOT)])}
        self.log = tmp_path / "gunicorn.log"
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "gunicorn"), "tiny_app:application", "--bind",
             f"127.0.0.1:{self.port}", "--worker-class", "muninn.web_worker.EpollThreadWorker",
             "--error-logfile", str(self.log), "--no-control-socket", *args],
            cwd=tmp_path, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                with self.connect() as s:
                    s.sendall(request("/ready"))
                    if read_answer(s)[0] == 200:
                        return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"gunicorn did not start:\n{self.log.read_text()}") from None
                time.sleep(0.2)

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(*args: str) -> Server:
        servers.append(Server(tmp_path, *args))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def request(path: str, body: bytes = b"") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def read_answer(s: socket.socket, buffered: bytearray | None = None) -> tuple[int, str]:
    """One HTTP answer from the socket: (status, body). `buffered`: what was read past the answer, kept across calls."""
    data = buffered if buffered is not None else bytearray()
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed before an answer")
        data += chunk
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside an answer")
        rest += chunk
    data[:] = rest[length:]
    return int(lines[0].split()[1]), rest[:length].decode()


def test_keep_alive_connection_serves_many_requests_and_pipelined_ones(serve):
    server = serve("--workers", "1", "--threads", "2")
    with server.connect() as s:
        buffered = bytearray()
        s.sendall(request("/one", b"abc"))
        assert read_answer(s, buffered)[1].startswith("/one 3 ")
        s.sendall(request("/two", b"x" * 70_000) + request("/three"))  # two requests in one write
        assert read_answer(s, buffered)[1].startswith("/two 70000 ")
        assert read_answer(s, buffered)[1].startswith("/three 0 ")
        s.sendall(request("/four"))
        assert read_answer(s, buffered)[1].startswith("/four 0 ")


def test_threads_serve_requests_at_once(serve):
    server = serve("--workers", "1", "--threads", "4")
    answers = []

    def together():
        with server.connect() as s:
            s.sendall(request("/together"))
            answers.append(read_answer(s))

    threads = [threading.Thread(target=together) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [status for status, _ in answers] == [200] * 4  # one thread at a time: the barrier breaks, each a 500


def test_idle_connection_is_closed_after_keep_alive(serve):
    server = serve("--workers", "1", "--threads", "2", "--keep-alive", "1")
    with server.connect() as s:
        s.sendall(request("/once"))
        assert read_answer(s)[0] == 200
        s.settimeout(20)
        assert s.recv(1) == b""  # the server closed it (a socket timeout here fails the test)


def test_request_waiting_for_a_thread_past_keep_alive_is_answered(serve):
    """With its only thread busy for 3 s, a kept-alive connection's next request waits in its socket past the 1 s
    keep-alive timeout. Closing such a socket would reset the device's request; it is served once the thread is free."""
    server = serve("--workers", "1", "--threads", "1", "--keep-alive", "1")
    with server.connect() as waiting, server.connect() as busy:
        waiting.sendall(request("/first"))
        assert read_answer(waiting)[0] == 200
        busy.sendall(request("/slow?3"))
        time.sleep(0.3)  # the slow request holds the thread
        waiting.sendall(request("/second"))
        assert read_answer(busy)[0] == 200
        status, body = read_answer(waiting)
        assert (status, body.split()[0]) == (200, "/second")


def test_graceful_stop_finishes_the_request_in_hand(serve):
    server = serve("--workers", "1", "--threads", "2", "--graceful-timeout", "20")
    with server.connect() as s:
        s.sendall(request("/slow?2"))
        time.sleep(0.5)  # in the app now
        server.proc.send_signal(signal.SIGTERM)
        status, body = read_answer(s)
    assert (status, body.split()[0]) == (200, "/slow")
    assert server.proc.wait(30) == 0


def test_max_requests_restarts_the_worker_and_loses_no_request(serve):
    server = serve("--workers", "1", "--threads", "2", "--max-requests", "3")
    pids = set()
    for i in range(10):
        with server.connect() as s:
            s.sendall(request(f"/n{i}"))
            status, body = read_answer(s)
        assert status == 200
        pids.add(body.split()[2])
    assert len(pids) >= 3  # a worker serves 3 requests, then a new one takes over


def test_request_sent_with_the_connection_is_served_and_the_connection_kept(serve):
    """A connection accepted with its first request already in it is served by the accepting thread; it is then
    kept alive like any other."""
    server = serve("--workers", "1", "--threads", "1")
    with server.connect() as busy:
        busy.sendall(request("/slow?1"))
        time.sleep(0.3)  # the only thread is in the app: the next connection waits to be accepted, its request with it
        with server.connect() as fresh:
            fresh.sendall(request("/first"))
            assert read_answer(busy)[0] == 200
            assert read_answer(fresh)[1].startswith("/first ")
            fresh.sendall(request("/again"))
            assert read_answer(fresh)[1].startswith("/again ")
