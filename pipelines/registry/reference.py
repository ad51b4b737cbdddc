"""How a user names a registry version: `NAME`, `NAME@VERSION` or `NAME@ALIAS` (`demo-llama@production`, `demo-llama@3`)."""

from __future__ import annotations

from pipelines.errors import InputError

MAX_VERSION = 2**31 - 1  # version numbers count up from 1 per model; beyond this is a typo (and past SQLite's range)


def version_number_or_error(text: str, field: str = "VERSION") -> int:
    """ASCII digits naming a version from 1 to MAX_VERSION; anything else is an InputError naming `field`."""
    if not text.isascii() or not text.isdigit() or len(text) > 30 or not 1 <= int(text) <= MAX_VERSION:
        raise InputError(f"must be an integer from 1 to {MAX_VERSION} (got {text!r})", field=field)
    return int(text)


def version_or_alias(text: str, field: str = "VERSION_OR_ALIAS") -> int | str:
    """A version number (ASCII digits, 1..MAX_VERSION) or an alias name; anything else is an InputError."""
    if text.isascii() and text.isdigit():
        return version_number_or_error(text, field)
    if not text or any(char.isdigit() for char in text if not char.isascii()) or not text.isprintable():
        raise InputError(f"not a version number or an alias name (got {text!r})", field=field)
    return text


def split_reference(text: str, field: str = "NAME") -> tuple[str, int | str | None]:
    """`NAME[@VERSION|ALIAS]` as (model, version number or alias, or None when only NAME is given)."""
    model, at, wanted = text.rpartition("@") if "@" in text else (text, "", "")
    if not model or not model.isprintable():
        raise InputError(f"not NAME[@VERSION|ALIAS] (got {text!r})", field=field)
    return model, (version_or_alias(wanted, field) if at else None)
