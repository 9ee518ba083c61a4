"""The remote-image fetcher's address policy. No packet leaves loopback: the classification is a pure function,
and every other name resolves through a fake resolver; refused addresses never reach the connect step."""

from __future__ import annotations

import ipaddress
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from heteroserve.multimodal import fetch as fetch_module
from heteroserve.multimodal.fetch import FetchError, fetch, is_public_address

NON_PUBLIC = [
    "0.0.0.0",
    "0.1.2.3",
    "10.1.2.3",
    "100.64.0.1",
    "127.0.0.1",
    "127.255.255.254",
    "169.254.169.254",
    "172.16.0.1",
    "172.31.255.255",
    "192.0.0.8",
    "192.0.2.1",
    "192.168.1.1",
    "198.18.0.1",
    "224.0.0.1",
    "239.255.255.250",
    "240.0.0.1",
    "255.255.255.255",
    "::",
    "::1",
    "::127.0.0.1",  # IPv4-compatible (deprecated)
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:169.254.169.254",
    "::ffff:10.0.0.1",
    "::ffff:0.0.0.0",
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "2002:a00:1::1",  # 6to4 of 10.0.0.1
    "2001:db8::1",
    "fc00::1",
    "fd12:3456::1",
    "fe80::1",
    "fe80::1%1",
    "fec0::1",
    "ff02::1",
]
PUBLIC = ["1.1.1.1", "8.8.8.8", "93.184.216.34", "::ffff:8.8.8.8", "2606:4700:4700::1111", "2002:808:808::1"]


@pytest.mark.parametrize("address", NON_PUBLIC)
def test_non_public_addresses(address):
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses(address):
    assert is_public_address(ipaddress.ip_address(address))


@pytest.fixture
def fake_dns(monkeypatch):
    """Names resolve from this table only (IP literals to themselves); each resolution is recorded."""
    table: dict[str, list[str]] = {}
    asked: list[str] = []

    def getaddrinfo(host, port, **_):
        asked.append(host)
        try:
            addresses = table.get(host) or [str(ipaddress.ip_address(host))]
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, "unknown name") from None
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses
        ]

    monkeypatch.setattr(fetch_module.socket, "getaddrinfo", getaddrinfo)
    return table, asked


@pytest.fixture
def no_connect(monkeypatch):
    def refuse(addresses, deadline):
        raise AssertionError(f"connected to {addresses}")

    monkeypatch.setattr(fetch_module, "_connect", refuse)


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/a.png",
        "http://0.0.0.0:8000/a.png",
        "http://[::ffff:127.0.0.1]/a.png",
        "http://[fd00::1]/a.png",
        "https://metadata.test/a.png",  # one of its addresses is private
        "http://2130706433/a.png",  # 127.0.0.1 written as a number
    ],
)
def test_non_public_hosts_are_refused_before_connecting(fake_dns, no_connect, url):
    table, _ = fake_dns
    table["metadata.test"] = ["93.184.216.34", "10.0.0.7"]
    table["2130706433"] = ["127.0.0.1"]
    with pytest.raises(FetchError, match="resolves to the non-public address"):
        fetch(url, 5, 1000)


def test_hosts_outside_the_allowed_domains_are_not_even_resolved(fake_dns, no_connect):
    _, asked = fake_dns
    with pytest.raises(FetchError, match="not in --allowed-media-domains"):
        fetch("http://elsewhere.test/a.png", 5, 1000, frozenset({"images.test"}))
    assert asked == []


@pytest.fixture
def local_server():
    """On 127.0.0.1: /a.png answers b"PNGDATA" and records the Host header; /hop redirects to internal.test."""
    hosts: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            hosts.append(self.headers["Host"])
            if self.path == "/hop":
                self.send_response(302)
                self.send_header("Location", "http://internal.test/a.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", "7")
            self.end_headers()
            self.wfile.write(b"PNGDATA")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server.server_address[1], hosts
    server.shutdown()
    server.server_close()


def test_the_connection_goes_to_the_checked_address_with_the_name_as_host(fake_dns, local_server):
    """An allowed name is resolved once; the socket connects to that answer, the name rides in Host."""
    table, asked = fake_dns
    port, hosts = local_server
    table["images.test"] = ["127.0.0.1"]
    assert fetch(f"http://Images.Test.:{port}/a.png", 5, 1000, frozenset({"images.test"})) == b"PNGDATA"
    assert asked == ["images.test"]
    assert hosts == [f"images.test:{port}"]


def test_every_redirect_hop_is_checked(fake_dns, local_server, monkeypatch):
    """A public host (here faked: its connection lands on the local server) redirects to a private one."""
    table, asked = fake_dns
    port, hosts = local_server
    table["public.test"] = ["93.184.216.34"]
    table["internal.test"] = ["10.0.0.7"]
    connected: list[str] = []
    real_connect = fetch_module._connect

    def to_local_server(addresses, deadline):
        connected.extend(info[4][0] for info in addresses)
        return real_connect([(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))], deadline)

    monkeypatch.setattr(fetch_module, "_connect", to_local_server)
    with pytest.raises(FetchError, match="internal.test resolves to the non-public address 10.0.0.7"):
        fetch(f"http://public.test:{port}/hop", 5, 1000)
    assert asked == ["public.test", "internal.test"]
    assert connected == ["93.184.216.34"]
    assert hosts == [f"public.test:{port}"]
