"""Images by http(s) URL, fetched by the server: off unless the operator names the domains they may come from
(``allowed_media_domains``, vLLM's engine argument), so a client cannot aim the server at internal addresses.

Where domains are allowed, a URL must name one of them (or a subdomain), every address its host resolves to
must be a public one (no loopback, private, link-local, reserved or multicast address: a public name that
resolves inside the network is refused too), redirects are not followed (each would need the same checks),
and the body is read up to ``max_image_bytes`` within a deadline. The resolution is checked before the
connection is made, so a domain on the allow-list whose DNS its owner turns to an internal address between
the two lookups could still reach it: allow only domains you control or trust.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

from cb_serve.errors import InvalidRequestError

FETCH_TIMEOUT_S = 10.0
SCHEMES = {"http": 80, "https": 443}


def _allowed(host: str, domains: Sequence[str]) -> bool:
    return any(host == d or host.endswith("." + d) for d in domains)


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def check_url(url: str, domains: Sequence[str], param: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an image URL the server may fetch; ``InvalidRequestError`` otherwise."""
    if not domains:
        raise InvalidRequestError(
            "Image URLs over http(s) are off on this server (allowed_media_domains is not set): send the image "
            "inline, as a data: URL or base64.",
            param,
        )
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or SCHEMES.get(parts.scheme.lower(), 0)
    except ValueError as e:
        raise InvalidRequestError(f"The image URL is malformed: {e}", param) from None
    host = (parts.hostname or "").lower().rstrip(".")
    if parts.scheme.lower() not in SCHEMES or not host:
        raise InvalidRequestError("An image URL is http(s)://host/... or a data: URL.", param)
    if parts.username or parts.password:
        raise InvalidRequestError("An image URL may not carry credentials.", param)
    if not _allowed(host, domains):
        raise InvalidRequestError(f"The image URL's host {host[:80]!r} is not in allowed_media_domains.", param)
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError) as e:
        raise InvalidRequestError(f"The image URL's host {host[:80]!r} does not resolve: {e}", param) from None
    if not addresses or not all(_public(a) for a in addresses):
        raise InvalidRequestError(
            f"The image URL's host {host[:80]!r} resolves to an internal address: refused.", param
        )
    return parts.scheme.lower(), host, port


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs) -> None:  # a 3xx becomes an HTTPError
        return None


def fetch_image(url: str, domains: Sequence[str], max_bytes: int, param: str) -> bytes:
    """The body of an allowed image URL (``check_url``), at most ``max_bytes``, no redirects, no proxies."""
    check_url(url, domains, param)
    opener = urllib.request.build_opener(_NoRedirects, urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, method="GET"), timeout=FETCH_TIMEOUT_S) as response:
            body = response.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise InvalidRequestError(f"Fetching the image URL gave HTTP {e.code}.", param) from None
    except (OSError, ValueError) as e:  # URLError, timeouts, resets
        raise InvalidRequestError(f"The image URL could not be fetched: {type(e).__name__}.", param) from None
    if len(body) > max_bytes:
        raise InvalidRequestError(f"An image is limited to {max_bytes} bytes.", param)
    return body
