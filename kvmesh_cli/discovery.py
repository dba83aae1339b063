"""Which engines ``kvmesh replay --router ...`` scrapes for the prefix-cache hit rate: from epp or etcd.

The replay itself goes through the router; epp and etcd only name the engines whose ``/metrics``
are read before and after (the hit rate measured at the engines). :func:`find_engines` asks, in order:

1. ``--epp``: epp's ``ListEndpoints`` (the pool the router routes to);
2. when that epp does not answer and ``--etcd`` is given: every other epp registered in etcd
   (``/kvmesh/v1/services/epp/<id>``, what each kvmesh service registers at start,
   :mod:`kvmesh.server`), then the engines registered there (``/kvmesh/v1/endpoints/``, what epp
   itself follows); each fallback is said in one line;
3. ``--etcd`` alone: the engines registered there.

An address that does not answer (and has no fallback) is a :class:`DiscoveryError` whose message is
one line naming the address and what to do; the command prints it and exits 1 before any request
is sent, never with a traceback. etcd is read once with a deadline (not watched), so an etcd that
refuses the connection fails at once, one that never answers in ``timeout_s`` (and a slow one is
waited for that long), instead of retrying in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

import aetcd
import grpc

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh.membership import ENDPOINTS_PREFIX, SERVICES_PREFIX, etcd_channel_options
from kvmesh.types import Endpoint

DISCOVERY_TIMEOUT_S = 5.0
"""Deadline of one ``ListEndpoints`` call and of one etcd read, seconds."""
EPP_SERVICE = "epp"
"""epp's service name in etcd (``ServiceSpec.name``)."""


class DiscoveryError(Exception):
    """epp or etcd did not answer and nothing could stand in; ``str()`` is one line for the user."""


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:port``) as ``(host, port)``.

    Raises:
        ValueError: no port, a port that is not 1-65535, or a URL (``http://...``) instead.
    """
    if "://" in address:
        raise ValueError(f"{address!r} is a URL; expected host:port")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{address!r} is not host:port (e.g. 127.0.0.1:2379)")
    if not port.isdigit():
        raise ValueError(f"{address!r} is not host:port: the port {port!r} is not an integer")
    if not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port: the port {port} is not in 1-65535")
    return host.strip("[]"), int(port)


def engines_from_epp(epp_address: str, timeout_s: float = DISCOVERY_TIMEOUT_S) -> list[str]:
    """Engine base URLs from epp's ``ListEndpoints``, sorted.

    Raises:
        grpc.RpcError: epp did not answer (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``), or the address is
            not an epp (``UNIMPLEMENTED``).
    """
    with grpc.insecure_channel(epp_address) as channel:
        reply = epp_pb2_grpc.EndpointPickerStub(channel).ListEndpoints(
            epp_pb2.ListEndpointsRequest(), timeout=timeout_s
        )
    return sorted({s.endpoint.url for s in reply.endpoints})


async def _read_prefix(etcd_address: str, prefix: str, timeout_s: float) -> list[bytes]:
    host, port = split_host_port(etcd_address)
    # The connection attempt may take timeout_s (etcd_channel_options); the call's own deadline and the
    # outer bound are a little later, so a handshake that never completes fails as gRPC's connect
    # error, which says what happened ("timed out before receiving SETTINGS frame"), at timeout_s.
    call_timeout = timeout_s + _CALL_GRACE_S
    client = aetcd.Client(host=host, port=port, timeout=call_timeout, options=etcd_channel_options(timeout_s))
    try:
        await asyncio.wait_for(client.connect(), call_timeout)
        result = await asyncio.wait_for(client.get_prefix(prefix.encode()), call_timeout + _CALL_GRACE_S)
        return [kv.value for kv in result]
    finally:
        with contextlib.suppress(Exception):  # closing a client that never connected
            await client.close()


_CALL_GRACE_S = 0.5
"""How much later than the connection attempt's deadline an etcd read's own deadline falls, seconds."""


def read_etcd_prefix(etcd_address: str, prefix: str, timeout_s: float = DISCOVERY_TIMEOUT_S,
                     hint: str = "pass the etcd the mesh registers in (kvmesh up prints it), or leave --etcd out",
                     ) -> list[bytes]:
    """The values under ``prefix`` in etcd, read once (``hint`` ends the error line).

    A slow etcd (its TCP + HTTP/2 handshake or its answer taking up to ``timeout_s``) is waited for;
    a refused connection fails at once.

    Raises:
        DiscoveryError: etcd refused the connection, or did not answer within ``timeout_s`` (one line
            naming it and saying which, :func:`why_unreachable`).
        ValueError: ``etcd_address`` is not ``host:port``.
    """
    from kvmesh_cli.mesh import run_interruptible

    split_host_port(etcd_address)
    started = time.monotonic()
    try:
        return run_interruptible(_read_prefix(etcd_address, prefix, timeout_s))
    except Exception as exc:  # aetcd and grpc raise several kinds for a dead or wrong address
        reason = why_unreachable(exc, timeout_s, time.monotonic() - started)
        raise DiscoveryError(f"etcd {etcd_address} {reason}; {hint}") from exc


def why_unreachable(exc: BaseException, timeout_s: float, elapsed_s: float | None = None) -> str:
    """What an address that failed with ``exc`` after ``elapsed_s`` did, for an error line; the first
    line of the cause follows in parentheses:

    - ``refused the connection``: nothing listens there (it failed at once);
    - ``accepted the connection but did not answer within 5s``: something listens but sent no HTTP/2
      answer (a stopped or overloaded process, or not a gRPC server);
    - ``did not answer within 5s``: another deadline ran out (``elapsed_s`` at least most of
      ``timeout_s``; a deadline that ran out sooner says ``gave up after 0.1s`` instead, the truth);
    - else ``could not be reached``.
    """
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    lowered = reason.lower()
    if "connection refused" in lowered:
        return f"refused the connection ({reason})"
    timed_out = isinstance(exc, TimeoutError) or "deadline" in lowered or "timed out" in lowered
    if timed_out:
        if elapsed_s is not None and elapsed_s < 0.8 * timeout_s:
            return f"gave up after {elapsed_s:.1f}s of the {timeout_s:g}s allowed ({reason})"
        silent = "before receiving settings frame" in lowered
        return f"{'accepted the connection but ' if silent else ''}did not answer within {timeout_s:g}s ({reason})"
    return f"could not be reached ({reason})"


def engines_from_etcd(etcd_address: str, timeout_s: float = DISCOVERY_TIMEOUT_S) -> list[str]:
    """Engine base URLs registered under ``/kvmesh/v1/endpoints/``, sorted (bad records skipped).

    Raises:
        DiscoveryError, ValueError: as :func:`read_etcd_prefix`.
    """
    urls: set[str] = set()
    for value in read_etcd_prefix(etcd_address, ENDPOINTS_PREFIX, timeout_s):
        try:
            urls.add(Endpoint.from_json(value).url)
        except ValueError:
            continue
    return sorted(urls)


def epps_from_etcd(etcd_address: str, timeout_s: float = DISCOVERY_TIMEOUT_S) -> list[str]:
    """gRPC addresses of the epp instances registered under ``/kvmesh/v1/services/epp/``, sorted.

    Raises:
        DiscoveryError, ValueError: as :func:`read_etcd_prefix`.
    """
    return services_from_etcd(etcd_address, EPP_SERVICE, timeout_s)


def services_from_etcd(etcd_address: str, service: str, timeout_s: float = DISCOVERY_TIMEOUT_S,
                       hint: str = "pass the etcd the mesh registers in (kvmesh up prints it), or leave --etcd out",
                       ) -> list[str]:
    """gRPC addresses of the ``service`` instances (``epp``, ``flow_control``, ...) registered under
    ``/kvmesh/v1/services/<service>/``, sorted (records without a ``grpc_address`` skipped).

    Raises:
        DiscoveryError, ValueError: as :func:`read_etcd_prefix`.
    """
    addresses: set[str] = set()
    for value in read_etcd_prefix(etcd_address, f"{SERVICES_PREFIX}{service}/", timeout_s, hint=hint):
        try:
            address = json.loads(value)["grpc_address"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(address, str) and address:
            addresses.add(address)
    return sorted(addresses)


def _rpc_reason(exc: grpc.RpcError) -> str:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    return code.name if code is not None else type(exc).__name__


def _epp_failed(exc: grpc.RpcError) -> str:
    """What the epp did, for an error line: refused the connection (nothing listens: it failed at
    once) or did not answer ListEndpoints; the status code in parentheses."""
    details = (exc.details() or "") if isinstance(exc, grpc.Call) else ""
    verb = "refused the connection" if "connection refused" in details.lower() else "did not answer ListEndpoints"
    return f"{verb} ({_rpc_reason(exc)})"


def find_engines(
    epp: str | None, etcd: str | None, say: Callable[[str], None], timeout_s: float = DISCOVERY_TIMEOUT_S
) -> list[str]:
    """The engine base URLs to scrape, from ``epp`` or, failing that, ``etcd`` (module docstring);
    ``[]`` when neither is given. ``say`` gets one line per fallback taken.

    Raises:
        DiscoveryError: ``epp`` did not answer and there is no ``etcd`` to fall back to, or ``etcd``
            did not answer; the message names the address and what to do.
        ValueError: ``epp`` or ``etcd`` is not ``host:port``.
    """
    if epp:
        split_host_port(epp)
    if etcd:
        split_host_port(etcd)
    if not epp:
        return engines_from_etcd(etcd, timeout_s) if etcd else []
    try:
        return engines_from_epp(epp, timeout_s)
    except grpc.RpcError as exc:
        failed = _epp_failed(exc)
        if not etcd:
            raise DiscoveryError(
                f"epp {epp} {failed}; start it, pass the epp's gRPC host:port "
                "(kvmesh up prints it), or add --etcd host:port to find the engines through etcd"
            ) from exc
    say(f"epp {epp} {failed}: looking for another in etcd {etcd}")
    for other in epps_from_etcd(etcd, timeout_s):
        if other == epp:
            continue
        try:
            urls = engines_from_epp(other, timeout_s)
        except grpc.RpcError:
            continue
        say(f"using epp {other}, registered in etcd {etcd}")
        return urls
    urls = engines_from_etcd(etcd, timeout_s)
    say(f"no epp registered in etcd {etcd} answered: using the {len(urls)} engine(s) registered there")
    return urls
