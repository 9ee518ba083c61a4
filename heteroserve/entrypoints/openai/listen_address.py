"""Where the server listens: the port checked and bound before the model loads, so a taken or invalid port is
told in one line within seconds rather than after minutes of loading."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import socket


class ListenAddressError(ValueError):
    """The host and port cannot be listened on (in use, not allowed, or not an address of this machine)."""


def port_number(value: str) -> int:
    """argparse type for --port: a TCP port, 0-65535 (0 lets the system choose)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range (0-65535)")
    return port


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening: clients are refused until uvicorn serves on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart despite TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = {
            errno.EADDRINUSE: "is in use",
            errno.EACCES: "needs privileges to bind",
            errno.EADDRNOTAVAIL: "is not an address of this machine",
        }
        problem = reason.get(exc.errno, f"cannot be bound ({exc.strerror})")
        target = f"{host} (port {port})" if exc.errno == errno.EADDRNOTAVAIL else f"port {port} on {host}"
        raise ListenAddressError(f"{target} {problem}") from exc
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (127.x, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def page_url(host: str, port: int) -> str:
    """The URL a person on this machine opens: 127.0.0.1 when the server listens on every interface."""
    if host in ("0.0.0.0", "::", ""):
        return f"http://127.0.0.1:{port}/"
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
