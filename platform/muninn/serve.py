"""The site's web server: granian (HTTP in Rust, the WSGI application on each worker's threads), started so that
its port listens from the first moment, as gunicorn's does.

    python -m muninn.serve [granian's options] muninn.wsgi:application

On Linux granian has each worker bind a socket of its own (SO_REUSEPORT) after the worker has loaded the
application: Django, torch and the rest, 4-8 s on the 2-core development machine. A site that was restarted
refused connections for that long, where gunicorn's master listens at once and connections wait in its backlog; a
worker client's retries could run out meanwhile and give up a trained unit's upload (tests/test_faults.py, the
web server restarted mid-upload). Here the main process binds one socket before it starts a worker, and every
worker accepts from it: the path granian itself takes on systems without SO_REUSEPORT. Pinned to the granian
version in pyproject.toml (this reaches into its server class); tests/test_serve.py and tests/test_faults.py would
notice a change.

Each worker, once it has loaded the application, installs granian's own SIGINT/SIGTERM handlers, which replace any
the application installed as it loaded. Here granian's are chained behind the application's, as gunicorn's are:
the site's ends the worker's held long-poll claims at once (jobs/wakeups.py), so a stopping worker answers them
(204: their devices claim again) and exits, instead of holding them until `--workers-kill-timeout` cuts them.
"""
from __future__ import annotations

import signal
import socket

from granian import _signals, cli
from granian.net import SocketSpec
from granian.server.mp import MPServer

_granian_sync_signals = _signals.set_sync_signals
_inherited: dict = {}  # the main process's signal handlers, which a forked worker starts with


class Server(MPServer):
    def _init_shared_socket(self):
        if self.bind_uds:  # granian's own way (a Unix socket is one socket already)
            return super()._init_shared_socket()
        self._shd = SocketSpec(self.bind_addr, self.bind_port, self.backlog).build()
        self._sfd = self._shd.get_fd()
        self._ssp = None
        self._sso = socket.socket(fileno=self._sfd)
        self._sso.set_inheritable(True)
        self._sso.listen(self.backlog)  # listening now: connections wait in the backlog until a worker accepts

    def _spawn_worker(self, idx, target, callback_loader):
        _inherited.update((sig, signal.getsignal(sig)) for sig in _signals._get_signals())
        return super()._spawn_worker(idx, target, callback_loader)


def _sync_signals_after_the_applications():
    """granian's set_sync_signals (run in a WSGI worker after the application has loaded), with any handler the
    application installed as it loaded run first."""
    installed = {sig: signal.getsignal(sig) for sig in _signals._get_signals()}
    event = _granian_sync_signals()
    for sig, application_handler in installed.items():
        granian_handler = signal.getsignal(sig)
        if application_handler is _inherited.get(sig):  # the application installed none
            continue
        if callable(application_handler) and callable(granian_handler):
            signal.signal(sig, _chain(application_handler, granian_handler))
    return event


def _chain(first, then):
    def handler(signum, frame):
        try:
            first(signum, frame)
        finally:
            then(signum, frame)

    return handler


def main() -> None:
    cli.Server = Server
    _signals.set_sync_signals = _sync_signals_after_the_applications  # read by each worker as it starts (fork)
    cli.entrypoint()


if __name__ == "__main__":
    main()
