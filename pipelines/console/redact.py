"""URLs as they may be shown or saved: their credentials out. The one place that does this, for watch's URLs, the
registry's PostgreSQL location and the MLflow mirror's messages and pending records."""

from __future__ import annotations

import re

# Every `://` up to the LAST @ before the path, query or whitespace: a password holding '@' is cut out whole. The scheme
# itself is not matched: a pattern for it is tried from each position of a long run of letters, quadratic (12 s of CPU
# for a 100 KB URL), and whatever precedes `://`, what follows up to an @ is a user part.
_USER_PART = re.compile(r"(://)[^/\s?#]*@")
_PASSWORD_PARAMETER = re.compile(r"(\bpassword=)[^&\s#]*", re.IGNORECASE)


def without_credentials(text: str) -> str:
    """`text` (a URL, or a message holding URLs) with each URL's user part (`user:password@`, `token@`) shown as `***@`
    and a `password=` parameter's value as `***`."""
    return _PASSWORD_PARAMETER.sub(r"\1***", _USER_PART.sub(r"\1***@", text))
