"""StarSD's error codes and the exception that carries one (the wire's ERROR message, a refused
parameter). Standard library only: every module that reports or reads an error imports it."""

from __future__ import annotations


class ErrorCode:
    """Error codes carried by :class:`Error` (strings, so logs and clients read them as-is)."""

    MALFORMED = "MALFORMED"
    VERSION_MISMATCH = "VERSION_MISMATCH"
    TOO_LARGE = "TOO_LARGE"
    INCOMPATIBLE = "INCOMPATIBLE"
    NOT_WELCOMED = "NOT_WELCOMED"
    UNKNOWN_SESSION = "UNKNOWN_SESSION"
    FORBIDDEN = "FORBIDDEN"
    OUT_OF_ORDER = "OUT_OF_ORDER"
    BUSY = "BUSY"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    CONTEXT_FULL = "CONTEXT_FULL"
    UNEXPECTED = "UNEXPECTED"
    INTERNAL = "INTERNAL"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class ProtocolError(Exception):
    """A frame or message that cannot be accepted; ``code`` is an :class:`ErrorCode` value."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
