"""kit_playground: the playground page that kit-serve serves at ``GET /`` (kit_playground.html).

Owns: finding the page (beside this module in a source tree, a vendored copy or an editable
install; among the distribution's data files, ``share/kit/``, in a normal install) and the
headers it is served with: a Content-Security-Policy that lets only the page's own inline script
and style run (by their SHA-256) and lets it connect only to its own origin.

Must never: route or answer requests (kit_http does), rewrite the page (one self-contained file:
inline script and style, no CDN, no build step, offline), or read a file at import.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import re
from pathlib import Path

__all__ = ("load", "PLAYGROUND_FILE")

#: The page's file name, beside this module and in the package's data files.
PLAYGROUND_FILE = "kit_playground.html"

Headers = tuple[tuple[bytes, bytes], ...]


def _read() -> bytes | None:
    beside = Path(__file__).with_name(PLAYGROUND_FILE)
    if beside.is_file():
        return beside.read_bytes()
    try:
        shipped = [f for f in importlib.metadata.files("kit") or () if f.name == PLAYGROUND_FILE]
    except importlib.metadata.PackageNotFoundError:  # vendored without the page
        return None
    return shipped[0].read_binary() if shipped else None


def _hashes(page: bytes, tag: bytes) -> str:
    """CSP source expressions for the page's inline ``<tag>`` blocks (CSP 3, hash-source)."""
    blocks = re.findall(rb"<%s>(.*?)</%s>" % (tag, tag), page, re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b).digest()).decode()}'" for b in blocks)


def load() -> tuple[bytes, Headers] | None:
    """The page (HTML) and its security headers, or None when this copy of kit lacks the file:
    its script and style run by hash, it fetches only from its own origin, nothing frames it."""
    page = _read()
    if page is None:
        return None
    csp = (f"default-src 'none'; script-src {_hashes(page, b'script')}; "
           f"style-src {_hashes(page, b'style')}; connect-src 'self'; img-src 'self' data:; "
           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return page, ((b"content-security-policy", csp.encode()), (b"x-content-type-options", b"nosniff"),
                  (b"referrer-policy", b"no-referrer"), (b"cache-control", b"no-store"))
