"""A request's decoded header block, checked as RFC 9113 section 8.3 asks and split into what a call uses."""

from __future__ import annotations

# headers RFC 9113 section 8.2.2 forbids in HTTP/2
_CONNECTION_HEADERS = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))


class RequestHead:
    """A decoded header block, validated (RFC 9113 section 8.3) and split into what the call uses. `error`
    says why it is not a well-formed request header block; `pseudo`: it has pseudo-headers (not trailers).
    `metadata`: the regular headers but those in TAKEN, which are read into attributes: content-type and
    content-length here, and what a call layer's subclass names in its TAKEN (read by its `take`)."""

    __slots__ = (
        "content_length",
        "ctype",
        "error",
        "metadata",
        "method",
        "path",
        "pseudo",
        "scheme",
    )

    TAKEN = frozenset((b"te", b"content-type", b"content-length"))

    def __init__(self, headers: list):
        self.path = self.method = None
        self.ctype = b""
        self.content_length: int | None = None
        self.error = ""
        self.pseudo = self.scheme = False
        taken = self.TAKEN
        meta = []
        seen: set = set()
        regular = False
        for name, value in headers:
            if name[:1] == b":":
                self.pseudo = True
                if regular:
                    self.error = "a pseudo-header after a regular header"
                elif name not in _REQUEST_PSEUDO:
                    self.error = "an unknown pseudo-header"
                elif name in seen:
                    self.error = "a duplicate pseudo-header"
                seen.add(name)
                if name == b":path":
                    self.path = value
                elif name == b":method":
                    self.method = value
                elif name == b":scheme":
                    self.scheme = True
                continue
            regular = True
            if name != name.lower():
                self.error = "an upper-case header name"
            elif name in _CONNECTION_HEADERS or (name == b"te" and value != b"trailers"):
                self.error = "a connection-specific header"
            elif name in taken:
                if name == b"content-type":
                    self.ctype = value
                elif name == b"content-length":
                    self.content_length = int(value) if value.isdigit() else -1
                elif name != b"te":
                    self.take(name, value)
                continue
            meta.append((name, value))
        self.metadata = tuple(meta)
        if not self.error and (not self.path or self.method is None or not self.scheme):
            self.error = "a missing or empty request pseudo-header"
        if not self.error and self.content_length == -1:
            self.error = "an invalid content-length"

    def take(self, name: bytes, value: bytes) -> None:
        """A header of a subclass's TAKEN (this class takes none of its own)."""
