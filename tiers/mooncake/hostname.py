"""The address a Mooncake client announces for its segment (`local_hostname`).

Other clients reach a lender's segment at the host part of the endpoint it registered, so
loopback works only when every client shares one host. Unset in the policy, a client takes the
source address of its route to the master: the address of the interface this host would use
to reach it, which other hosts of the cluster reach too when they reach the master. A master
on loopback gives loopback (a single-host setup stays on `lo`). An explicit value wins.
"""

from __future__ import annotations

import ipaddress
import socket

from kvtier.store.base.errors import TierUnavailableError


def route_source(host: str, port: int) -> str:
    """This host's source address for packets to `host:port` (nothing is sent: a UDP
    socket's `connect` only picks the route)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise TierUnavailableError(f"the master's host {host!r} does not resolve ({e}); fix "
                                   "master.address or set local_hostname on the tier") from None
    family, _, _, _, addr = infos[0]
    if ipaddress.ip_address(addr[0]).is_loopback:
        return addr[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)
        except OSError as e:
            raise TierUnavailableError(
                f"no route from this host to the master at {host}:{port} ({e.strerror}); "
                "check the network, or set local_hostname on the tier") from None
        return s.getsockname()[0]


def announced_host(local_hostname: str | None, master_host: str, master_port: int) -> str:
    """`local_hostname` when the policy sets it, else this host's route source to the master."""
    if local_hostname:
        return local_hostname
    return route_source(master_host, master_port)


def host_of(endpoint: str) -> str:
    """The host part of a transport endpoint (`host:port`, `[v6]:port`)."""
    return endpoint.rsplit(":", 1)[0].strip("[]")
