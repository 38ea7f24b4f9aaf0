"""kit_checks: the input checks every surface shares (names, ids, texts, limits, settings).

Owns: ``check_name`` (an agent, workflow, server or namespace name: it appears in URLs),
``check_id`` (a session, thread or run id: ``MAX_ID_CHARS``, storable, showable), ``check_text``
(a text every store can hold), ``check_limit``, ``count_setting`` and ``switch_setting`` (a
setting's text as a count or a switch), ``printable`` (client text as a log line shows it) and
``HTTP_TOKEN``. ``kit_core`` re-exports every name, so callers import them from there.

Must never: import a sibling module other than ``kit_errors``, or do I/O, read the environment
(a setting's text is passed in) or keep state.

Theory of operation: each check returns the value it was given when it is valid, and raises
``ConfigError`` naming ``what`` was wrong (a value from outside quoted, cut to
``kit_errors.MAX_QUOTED_CHARS``) before anything is written or started.
"""
from __future__ import annotations

import re

from kit_errors import ConfigError, quoted

__all__ = ("check_name", "check_id", "check_text", "check_limit", "count_setting",
           "switch_setting", "printable", "MAX_ID_CHARS", "HTTP_TOKEN")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")


def check_name(what: str, name: object) -> str:
    """``name`` if it is a valid agent, workflow, server or namespace name (it appears in URLs);
    raises ``ConfigError`` naming ``what`` otherwise."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{what} name must be 1-128 characters of letters, digits, '_', '.' "
                          "or '-' starting with a letter or digit (it appears in URLs), got "
                          f"{quoted(name)}")
    return name


#: The longest id (a session, thread or run id) kit takes. Ids are indexed, and Postgres cannot
#: index a value past ~2.7 kB: 256 characters are at most 1 kB of UTF-8, two of them in one row.
MAX_ID_CHARS = 256
#: What no store can hold: NUL (Postgres text) and lone surrogates (not UTF-8).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
#: What no id may hold: those, and control characters (a newline, an escape sequence).
_NOT_IN_ID = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
#: An HTTP header name (RFC 9110 section 5.6.2, a token); match it with ``fullmatch``.
HTTP_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def check_id(what: str, value: object) -> str:
    """``value`` if it is an id kit can store, index and show (a session, thread or run id): a
    non-empty str of at most ``MAX_ID_CHARS`` characters with no control character and no lone
    surrogate, nor ``.`` or ``..`` (a URL's dot segments, which HTTP clients resolve away: such a
    run or session could never be named over HTTP). Raises ``ConfigError`` naming ``what``
    otherwise, before anything is written."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what} must be a non-empty str, got {quoted(value)}")
    if value in (".", ".."):
        raise ConfigError(f"{what} must not be {value!r}: HTTP clients resolve it away in a URL")
    if len(value) > MAX_ID_CHARS:
        raise ConfigError(f"{what} must be at most {MAX_ID_CHARS} characters, got {len(value)}")
    _refuse(what, value, _NOT_IN_ID, "a control character or a lone surrogate")
    return value


def check_text(what: str, value: object) -> str | None:
    """``value`` if it is None or a str every store can hold (no NUL, no lone surrogate), such
    as a control request's reason. Raises ``ConfigError`` naming ``what`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a str or None, got {type(value).__name__}")
    _refuse(what, value, _UNSTORABLE, "a NUL or a lone surrogate")
    return value


def _refuse(what: str, value: str, pattern: re.Pattern[str], kind: str) -> None:
    bad = pattern.search(value)
    if bad is not None:
        raise ConfigError(f"{what} must not hold {kind}, got {bad.group()!r} at character "
                          f"{bad.start()}")


def printable(text: str) -> str:
    """``text`` as a terminal or a log line should show text a client wrote: each character
    ``repr`` escapes (control characters, line separators, bidi overrides) as ``repr`` escapes
    it (``\\x1b``, ``\\n``, ``\\u202e``), printable Unicode as is. One line, no control sequence."""
    return text if text.isprintable() else "".join(
        c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_limit(what: str, value: object) -> int | None:
    """``value`` if it is None or a positive int (a bool is not one); raises ``ConfigError``
    naming ``what`` and the value otherwise."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value  # type: ignore[return-value]
    raise ConfigError(f"{what} must be a positive int or None, got {quoted(value)}")


def count_setting(name: str, raw: str | None) -> int | None:
    """The positive integer a setting ``name`` holds as text ``raw``; None when it is unset or
    blank (an exported empty variable means unset). Raises ``ConfigError`` naming it otherwise."""
    text = "" if raw is None else raw.strip()
    if not text:
        return None
    if not text.isdecimal() or int(text) < 1:  # isdigit takes '²', which int() refuses
        raise ConfigError(f"{name} must be a positive integer, got {quoted(raw)}")
    return int(text)


def switch_setting(name: str, raw: str | None, default: bool) -> bool:
    """The on/off a setting ``name`` holds as text ``raw`` (``1``/``true``/``yes``/``on`` or
    ``0``/``false``/``no``/``off``, any case); ``default`` when it is unset or blank. Raises
    ``ConfigError`` naming it otherwise (an unknown word turned a switch off without a word)."""
    text = "" if raw is None else raw.strip().lower()
    if not text:
        return default
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be 1, true, yes or on, or 0, false, no or off, got "
                      f"{quoted(raw)}")
