"""The product's one check of a URL it is given (watch's --url and --prometheus, an MLflow tracking URI, a PostgreSQL
registry location, a canary's server): what urllib, http.client and httpx would otherwise refuse deep inside a request
(an `InvalidURL`, a `ValueError` from a port that is no number or an unclosed IPv6 bracket, a host no resolver takes) is
refused here, as one InputError naming the option, with the URL shown without its credentials and cut short."""

from __future__ import annotations

import re
from urllib.parse import SplitResult, urlsplit

from pipelines.console.redact import without_credentials
from pipelines.errors import InputError

MAX_URL_CHARS = 2048  # what browsers and proxies take; a longer URL is refused, so that no error line carries 100 KB of it
HTTP_SCHEMES = ("http", "https")
_CONTROL_OR_SPACE = re.compile(r"[\x00-\x20\x7f-\x9f]")
_SHOWN_CHARS = 120


def shown_url(url: str, limit: int = _SHOWN_CHARS) -> str:
    """`url` as an error line may show it: credentials out, control characters escaped, cut to `limit` characters."""
    text = without_credentials(url).encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def checked_url(url: str, field: str, schemes: tuple[str, ...] = HTTP_SCHEMES, *, default_port: bool = True) -> SplitResult:
    """The parts of `url` when it is a URL of one of `schemes` with a host (IDNA-encodable), a port in 1-65535 (or none,
    when `default_port`) and no whitespace or control character; an InputError naming `field` otherwise."""

    def refuse(problem: str) -> InputError:
        kind = "an http(s)" if schemes == HTTP_SCHEMES else f"a {'/'.join(schemes)}"
        return InputError(f"not {kind} URL: {problem} (got {shown_url(url)!r})", field=field)

    if not isinstance(url, str) or not url:
        raise refuse("empty")
    if len(url) > MAX_URL_CHARS:
        raise refuse(f"{len(url):,} characters (at most {MAX_URL_CHARS})")
    found = _CONTROL_OR_SPACE.search(url)
    if found:
        raise refuse(f"a space or control character (U+{ord(found.group()):04X}) at position {found.start()}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:  # an unclosed IPv6 bracket, a port that is no number or out of range
        raise refuse(str(error)) from None
    if parts.scheme.lower() not in schemes:
        raise refuse(f"the scheme is {parts.scheme[:20]!r}, not {' or '.join(schemes)}")
    host = parts.hostname
    if not host:
        raise refuse("no host")
    if port is None and not default_port:
        raise refuse("no port")
    if port is not None and not 0 < port < 65536:
        raise refuse(f"port {port} is not from 1 to 65535")
    if ":" not in host:  # an IPv6 literal needs no IDNA; a name must be one a resolver takes
        try:
            host.encode("idna")
        except UnicodeError:
            raise refuse("the host is not a name a resolver takes (IDNA)") from None
    return parts


def checked_store_uri(uri: str, field: str) -> str:
    """A store's URI (an MLflow tracking URI: http(s)://, sqlite:///, file:, a path): an http(s) one checked as `checked_url`
    does; any other refused only for what no store takes (empty, whitespace or control characters, over MAX_URL_CHARS)."""
    if uri.partition("://")[0].lower() in HTTP_SCHEMES:
        checked_url(uri, field)
        return uri
    found = _CONTROL_OR_SPACE.search(uri)
    problem = ("empty" if not uri else f"{len(uri):,} characters (at most {MAX_URL_CHARS})" if len(uri) > MAX_URL_CHARS
               else f"a space or control character (U+{ord(found.group()):04X})" if found else None)
    if problem is not None:
        raise InputError(f"not a usable URI: {problem} (got {shown_url(uri)!r})", field=field)
    return uri
