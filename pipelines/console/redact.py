"""URLs as they may be shown or saved: their credentials out. The one place that does this, for watch's URLs, the
registry's PostgreSQL location and the MLflow mirror's messages and pending records."""

from __future__ import annotations

import re

# A scheme's `//` up to the LAST @ before the path, query or whitespace: a password holding '@' is cut out whole.
_USER_PART = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s?#]*@")
_PASSWORD_PARAMETER = re.compile(r"(\bpassword=)[^&\s#]*", re.IGNORECASE)


def without_credentials(text: str) -> str:
    """`text` (a URL, or a message holding URLs) with each URL's user part (`user:password@`, `token@`) shown as `***@`
    and a `password=` parameter's value as `***`."""
    return _PASSWORD_PARAMETER.sub(r"\1***", _USER_PART.sub(r"\1***@", text))
