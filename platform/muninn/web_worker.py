"""The site's gunicorn worker: gunicorn's threaded worker (gthread), with each thread waiting on the sockets itself.

    gunicorn muninn.wsgi:application --worker-class muninn.web_worker.EpollThreadWorker --threads 16 ...

gthread hands every request across threads twice: its main thread waits on the sockets, passes a readable connection
to a pool thread (a futures queue), and the pool thread passes it back through a pipe to be watched again. A device's
request mostly finds those threads asleep, so each request wakes two of them, and on a virtual machine waking a thread
on an idle core is dear. Under bench/load.py's paced devices gthread's layer cost 1.06-1.10 ms of CPU a request for an
app that does nothing, against 0.49 ms when saturated (the README, the load benchmark's fourteenth session).

Here every thread waits on one epoll set itself, each socket armed for one event at a time (EPOLLONESHOT): the thread
that the kernel wakes for a readable connection serves its request and re-arms it. One wake a request, no queue, no
pipe (the leader/follower pattern). Everything else is gthread's own code: the connection (TConn), the HTTP parser,
the request's handling and its access log, keep-alive and its limits, max_requests, graceful stop. A long-poll claim
holds its thread as it does under gthread.

Linux only (epoll). Elsewhere, and with TLS (a proxy in front terminates it), it is gthread unchanged.
"""
from __future__ import annotations

import errno
import select
import socket
import sys
import threading
import time

from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, TConn, ThreadWorker

_ARMED = getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLONESHOT", 0) | getattr(select, "EPOLLRDHUP", 0)
HOUSEKEEPING_S = 0.5  # the main thread's beat: the arbiter's liveness file, idle connections' timeouts, the parent
POLL_S = 0.5  # how long a serving thread waits before it checks whether the worker is stopping


def _request_waiting(sock) -> bool:
    """Whether bytes wait to be read on the socket (not the peer's end of it, nor nothing)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing to read (EAGAIN), or the connection is broken
        return False


class EpollThreadWorker(ThreadWorker):

    def init_process(self):
        self.epolled = hasattr(select, "epoll") and not self.cfg.is_ssl
        if not self.epolled:
            return super().init_process()
        self.epoll = select.epoll()
        self.lock = threading.Lock()  # guards the tables below, nr_conns, and each socket's registration
        self.idle: dict[int, TConn] = {}  # fd → a connection armed in the epoll set, waiting for its next request
        self.keepalived_conns = self.idle  # gthread's name: handle_request refuses keep-alive past max_keepalived
        self.listeners = {}  # fd → listening socket
        self.accepting = False
        self.stop_by = None  # monotonic time the serving threads stop at, once the worker is stopping
        # base.Worker.init_process: signals, the app, then run()
        super(ThreadWorker, self).init_process()

    def handle_exit(self, sig, frame):
        if not getattr(self, "epolled", False):
            return super().handle_exit(sig, frame)
        self.alive = False

    def handle_quit(self, sig, frame):
        if not getattr(self, "epolled", False):
            return super().handle_quit(sig, frame)
        self.alive = False
        self.cfg.worker_int(self)
        time.sleep(0.1)
        sys.exit(0)

    def run(self):
        if not self.epolled:
            return super().run()
        for listener in self.sockets:
            listener.setblocking(False)
            self.listeners[listener.fileno()] = listener
        with self.lock:
            self._accept_enabled(True)
        threads = [threading.Thread(target=self._serve, name=f"web-{i}", daemon=True)
                   for i in range(self.cfg.threads)]
        for thread in threads:
            thread.start()
        while self.alive:
            self.notify()
            time.sleep(HOUSEKEEPING_S)
            if not self.is_parent_alive():
                self.alive = False
            self._close_idle(time.monotonic())
        # Stopping: no new connections; a request already on its way on a kept-alive connection is still answered
        # (with "Connection: close") for a moment, while any connection is open; the requests in hand get the
        # graceful timeout.
        with self.lock:
            self._accept_enabled(False)
        linger_until = time.monotonic() + min(STOP_KEEPALIVE_LINGER, self.cfg.graceful_timeout)
        while self.nr_conns > 0 and time.monotonic() < linger_until:
            time.sleep(0.05)
        self.stop_by = time.monotonic()
        deadline = self.stop_by + self.cfg.graceful_timeout
        for thread in threads:
            self.notify()
            thread.join(max(deadline - time.monotonic(), 0))
        self._close_idle(float("inf"))
        self.epoll.close()
        for listener in self.sockets:
            listener.close()

    def _serving(self) -> bool:
        return self.alive or self.stop_by is None or time.monotonic() < self.stop_by

    def _serve(self):
        while self._serving():
            try:
                events = self.epoll.poll(POLL_S, 1)
            except InterruptedError:
                continue
            except (OSError, ValueError):  # the set was closed: the worker is gone
                return
            for fd, _ in events:
                try:
                    listener = self.listeners.get(fd)
                    if listener is not None:
                        self._accept(listener)
                    else:
                        self._serve_connection(fd)
                except Exception:  # the thread must outlive any one connection
                    self.log.exception("Error serving a connection")

    def _serve_connection(self, fd: int):
        with self.lock:
            conn = self.idle.pop(fd, None)  # None: closed meanwhile (timed out); its fd may already be another's
        if conn is not None:
            self._serve_taken(fd, conn)

    def _serve_taken(self, fd: int, conn: TConn):
        """Serve the requests waiting on a connection this thread holds, then arm it again (or close it)."""
        conn.data_ready = True  # it is readable: gthread.handle need not wait for its first bytes
        keep = self.handle(conn)
        # A body read past its end may hold the next request already: the socket no longer looks readable for it.
        while keep and self.alive and conn.parser.unreader.buf.getvalue():
            keep = self.handle(conn)
        with self.lock:
            if keep and self._serving():
                conn.set_timeout()
                self.idle[fd] = conn
                try:
                    self.epoll.modify(fd, _ARMED)
                    return
                except OSError:
                    del self.idle[fd]
            self._forget(fd, conn)

    def _accept(self, listener):
        try:
            sock, client = listener.accept()
        except OSError as e:  # another process's thread took it, or the peer gave up
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED, errno.EINTR):
                raise
            sock = None
        first = False
        with self.lock:
            if sock is not None:
                conn = TConn(self.cfg, sock, client, listener.getsockname())
                sock.setblocking(True)  # served by blocking reads and writes, as in gthread's pool threads
                conn.set_timeout()  # the keep-alive timeout bounds the wait for its first request too
                self.nr_conns += 1
                # A device sends its request as it connects: when it is here already, this thread serves it now,
                # rather than queueing the connection behind every other readable one a second time. Registered
                # unarmed meanwhile (ONESHOT with no event asked for), so that serving it ends as for any other.
                first = _request_waiting(sock)
                if not first:
                    self.idle[sock.fileno()] = conn
                self.epoll.register(sock.fileno(), select.EPOLLONESHOT if first else _ARMED)
            self._accept_enabled(self.alive and self.nr_conns < self.worker_connections)
        if first:
            self._serve_taken(sock.fileno(), conn)

    def _accept_enabled(self, enabled: bool):
        """Arm the listening sockets for one connection each, or leave them disarmed (at worker_connections, or
        stopping). Called with the lock held."""
        for fd in self.listeners:
            if enabled and not self.accepting:
                self.epoll.register(fd, _ARMED)
            elif enabled:
                self.epoll.modify(fd, _ARMED)
            elif self.accepting:
                self.epoll.unregister(fd)
        self.accepting = enabled

    def _close_idle(self, now: float):
        """Close the connections that waited longer than the keep-alive timeout (all of them, at the end). One whose
        next request has arrived is left to the thread the kernel wakes for it: on a busy worker a request can wait
        for a free thread past the timeout, and closing its socket then would reset it (gthread moves a readable
        connection off its keep-alive list at once, so it never closes one with a request in it either)."""
        with self.lock:
            for fd, conn in [(fd, conn) for fd, conn in self.idle.items() if conn.timeout <= now]:
                if now != float("inf") and _request_waiting(conn.sock):
                    continue
                del self.idle[fd]
                self._forget(fd, conn)

    def _forget(self, fd: int, conn: TConn):
        """Close a connection no thread holds. Called with the lock held."""
        try:
            self.epoll.unregister(fd)
        except (OSError, ValueError):
            pass
        conn.close()
        self.nr_conns -= 1
        if self.alive and not self.accepting and self.nr_conns < self.worker_connections:
            self._accept_enabled(True)
