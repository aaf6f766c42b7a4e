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
"""
from __future__ import annotations

import socket

from granian import cli
from granian.net import SocketSpec
from granian.server.mp import MPServer


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


def main() -> None:
    cli.Server = Server
    cli.entrypoint()


if __name__ == "__main__":
    main()
