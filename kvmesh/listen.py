"""Listening sockets of kvmesh processes, and the one error for a listener that cannot bind (pure stdlib).

:func:`bind_tcp` binds the HTTP listeners (:class:`kvmesh.http_server.HttpServer`, the simulator);
:class:`ListenError` is what every listener's start-up raises when its address cannot be bound (the
HTTP server, :class:`kvmesh.server.GrpcService`'s gRPC and metrics listeners), and what
:func:`kvmesh.server.main` turns into one line on stderr and exit status 1 instead of a traceback.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping

_PORT_HINT = re.compile(r"(choose another port with )(--[A-Za-z0-9-]+)")


class ListenError(OSError):
    """A server of this process could not listen on its address (a port in use, no such interface).

    Raised by the start-up code (:meth:`HttpServer.start`, :class:`kvmesh.server.GrpcService`'s gRPC and
    metrics listeners); :func:`kvmesh.server.main` turns it into one line on stderr and exit status 1.

    Attributes:
        what: which listener (``"http"``, ``"grpc"``, ``"metrics"``).
        host, port: the address asked for.
        reason: why, in the kernel's words (``"Address already in use"``).
    """

    def __init__(self, what: str, host: str, port: int, reason: str) -> None:
        super().__init__(f"cannot listen for {what} on {host}:{port}: {reason}")
        self.what, self.host, self.port, self.reason = what, host, port, reason

    @property
    def flag(self) -> str:
        """The process's own flag for this listener's port (``--http-port``, ``--grpc-port``, ``--metrics-port``)."""
        return f"--{self.what}-port"

    def hint(self) -> str:
        """What to do about it, naming :attr:`flag`; a launcher that starts the process under flags of its
        own rewrites the name with :func:`rename_port_flags`."""
        return f"another process may be listening there; choose another port with {self.flag}"

    @classmethod
    def probe(cls, what: str, host: str, port: int, fallback: str) -> ListenError:
        """The error for a listener that failed without saying why (gRPC's "Failed to bind"): the
        kernel's reason from binding the address once more (released at once), else ``fallback``."""
        try:
            bind_tcp(host, port).close()
        except OSError as exc:
            return cls(what, host, port, exc.strerror or str(exc))
        return cls(what, host, port, fallback)


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: the kernel picks a free port; read ``getsockname()``).

    ``SO_REUSEADDR`` only (a restart may rebind a port in TIME_WAIT), never ``SO_REUSEPORT``: a port
    another process listens on is an ``OSError`` here, not a silently shared port.

    Raises:
        OSError: the address cannot be bound (in use, no such interface).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def rename_port_flags(text: str, flags: Mapping[str, str]) -> str:
    """``text`` (a process's stderr or log tail) with the port flag each :meth:`ListenError.hint` names
    replaced by the launcher's own flag for it (``{"--http-port": "--router-port"}`` for ``kvmesh up``'s
    router); a flag without an entry is left as it is.

    Example: ``"... choose another port with --http-port)"`` -> ``"... choose another port with --router-port)"``.
    """
    return _PORT_HINT.sub(lambda m: m.group(1) + flags.get(m.group(2), m.group(2)), text)
