"""Fetches a client's remote image without letting the client reach what only the server can reach (SSRF).

Each host, the URL's and every redirect's (followed here, at most `MAX_REDIRECTS`), is resolved once. Unless
the operator named it in `--allowed-media-domains`, every address it resolves to must be public, and the
socket connects to a checked address itself: the name travels only in the Host header and TLS's SNI (the
certificate is verified against it), so no second DNS answer can swap in another address between the check
and the connection (DNS rebinding). Proxies from the environment are not used: one would bypass the check.

The whole fetch has one deadline: every wait (resolution, connection, TLS handshake, each receive) gets only
the time left, so a server dripping a byte at a time holds a request no longer than that; the body is cut as
soon as it passes the size cap. Failures raise `FetchError` naming the reason, for the server's log only.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import io
import ipaddress
import socket
import ssl
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urljoin, urlsplit

MAX_REDIRECTS = 3  # enough for http -> https -> a CDN; each hop is checked like the first
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
CHUNK_BYTES = 64 * 1024

NON_PUBLIC_IPV4 = tuple(
    ipaddress.IPv4Network(network)
    for network in (
        "0.0.0.0/8",  # "this network", 0.0.0.0 (which reaches the local host) included
        "10.0.0.0/8",  # private
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local, cloud metadata services (169.254.169.254) included
        "172.16.0.0/12",  # private
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # documentation
        "192.88.99.0/24",  # 6to4 relays (deprecated)
        "192.168.0.0/16",  # private
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # documentation
        "203.0.113.0/24",  # documentation
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, 255.255.255.255 included
    )
)
NON_PUBLIC_IPV6 = tuple(
    ipaddress.IPv6Network(network)
    for network in (
        "::/96",  # unspecified (::), loopback (::1) and the deprecated IPv4-compatible ::a.b.c.d
        "64:ff9b:1::/48",  # local-use NAT64
        "100::/64",  # discard-only
        "2001::/23",  # IETF protocol assignments, Teredo included
        "2001:db8::/32",  # documentation
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
)
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known prefix: the last 32 bits are an IPv4 address

# getaddrinfo has no timeout of its own; running it here lets a fetch stop waiting at its deadline.
_resolver = ThreadPoolExecutor(max_workers=4, thread_name_prefix="media-resolve")


class FetchError(Exception):
    """Why a remote image was not fetched: for the server's log, never for the client."""


def is_public_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether `address` is public unicast. An IPv6 address that carries an IPv4 one (IPv4-mapped, 6to4,
    NAT64) is judged by the IPv4 address, where its packets end up."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_address(embedded)
        return not any(address in network for network in NON_PUBLIC_IPV6)
    return not any(address in network for network in NON_PUBLIC_IPV4)


def normalized_host(host: str) -> str:
    """A host name as URLs and `--allowed-media-domains` are compared: lower case, ASCII (IDNA), no final dot
    and no IPv6 brackets."""
    return host.strip("[]").rstrip(".").lower().encode("idna").decode("ascii")


def fetch(url: str, timeout_s: float, max_bytes: int, allowed_hosts: frozenset[str] | None = None) -> bytes:
    """The body of the http(s) `url`, redirects followed. `allowed_hosts`: the only hosts fetched from, on any
    address; None: any host whose addresses are all public."""
    deadline = time.monotonic() + timeout_s
    allowed = None if allowed_hosts is None else {normalized_host(host) for host in allowed_hosts}
    try:
        for _ in range(MAX_REDIRECTS + 1):
            with _get(url, deadline, allowed) as response:
                if response.status in REDIRECT_STATUSES:
                    location = response.getheader("Location")
                    if not location:
                        raise FetchError(f"{url} answered {response.status} without a Location")
                    url = urljoin(url, location)
                    continue
                if response.status != 200:
                    raise FetchError(f"{url} answered HTTP {response.status}")
                return _read_body(response, max_bytes)
        raise FetchError(f"more than {MAX_REDIRECTS} redirects")
    except TimeoutError as exc:
        raise FetchError(f"{url} was not done by the deadline of {timeout_s} s (--media-fetch-timeout)") from exc
    except (OSError, http.client.HTTPException, ValueError) as exc:  # UnicodeError included
        raise FetchError(f"{url}: {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _get(url: str, deadline: float, allowed: set[str] | None) -> Iterator[http.client.HTTPResponse]:
    """One GET of `url`, on a connection to an address the policy allows, closed on leaving."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise FetchError(f"{url} is not an http(s) URL")
    host = normalized_host(parts.hostname or "")
    if not host:
        raise FetchError(f"{url} has no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if not target.isascii() or any(c <= " " or c == "\x7f" for c in target):
        raise FetchError(f"{url} has characters in its path that must be percent-encoded")
    if allowed is not None and host not in allowed:
        raise FetchError(f"{host} is not in --allowed-media-domains")
    addresses = _resolve(host, port, deadline)
    if allowed is None:
        denied = [info[4][0] for info in addresses if not is_public_address(ipaddress.ip_address(info[4][0]))]
        if denied:
            raise FetchError(f"{host} resolves to the non-public address {denied[0]}")
    sock = _connect(addresses, deadline)
    try:
        if parts.scheme == "https":
            sock.settimeout(_time_left(deadline))  # Python bounds the whole handshake by it
            sock = _tls_context().wrap_socket(sock, server_hostname=host)
        authority = f"[{host}]" if ":" in host else host
        authority += f":{parts.port}" if parts.port else ""
        request = (
            f"GET {target} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: heteroserve\r\nAccept: image/*\r\n"
            "Accept-Encoding: identity\r\nConnection: close\r\n\r\n"
        )
        sock.settimeout(_time_left(deadline))  # and all of sendall
        sock.sendall(request.encode("ascii"))
        response = http.client.HTTPResponse(_DeadlineSocket(sock, deadline), method="GET")
        response.begin()
        yield response
    finally:
        sock.close()


def _resolve(host: str, port: int, deadline: float) -> list[tuple]:
    """`host`'s addresses, resolved once: the connection uses these, never a second answer."""
    future = _resolver.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    return future.result(timeout=_time_left(deadline))


def _connect(addresses: list[tuple], deadline: float) -> socket.socket:
    """A socket connected to the first of the checked `addresses` that accepts (else the last one's error)."""
    for tried, (family, kind, proto, _, sockaddr) in enumerate(addresses, 1):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(_time_left(deadline))
            sock.connect(sockaddr)
            return sock
        except OSError:
            sock.close()
            if tried == len(addresses):
                raise
    raise FetchError("no address to connect to")


def _read_body(response: http.client.HTTPResponse, max_bytes: int) -> bytes:
    """The body, refused as soon as it passes `max_bytes` (whatever Content-Length claims)."""
    declared = response.getheader("Content-Length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise FetchError(f"the body of {declared} bytes is larger than the limit of {max_bytes} bytes")
    body = bytearray()
    while chunk := response.read(CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise FetchError(f"the body is larger than the limit of {max_bytes} bytes")
    return bytes(body)


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


class _DeadlineSocket:
    """What `http.client.HTTPResponse` needs of a socket (`makefile`), each receive bounded by the time left."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self.sock, self.deadline))


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        self.sock.settimeout(_time_left(self.deadline))
        return self.sock.recv_into(buffer)
