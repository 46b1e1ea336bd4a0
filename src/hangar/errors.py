"""Hangar's error hierarchy.

Errors are classed by what the caller should do, and each maps to one HTTP
status in the REST API (``hangar.api.errors``) and back to the same class in
the client SDK (``hangar.client``)::

    HangarError                      base; ``context`` holds ids and figures
    ├── InvalidRequest          400  fix the request (bad path, bad key name)
    ├── Unauthorized            401  no or wrong API key
    ├── Unavailable             503  the server could not be reached (client side; retry)
    ├── NotFound                404  no such sandbox, file or image
    ├── Gone                    410  the sandbox existed but expired
    ├── Conflict                409  the object's state forbids the call now
    │   ├── Busy                409  retryable: try again shortly
    │   └── ImageMissing        409  the image build a sandbox or snapshot pins is gone
    ├── TooLarge                413  the request body is over the server's limit
    ├── LimitExceeded           429  retryable after ``retry_after`` seconds
    ├── Timeout                 504  the guest did not answer in time
    ├── GuestError              502  the guest agent reported a failure
    ├── EngineError             500  the VMM failed (boot, QMP, process died)
    ├── ImageError              500  building or finding a guest image failed
    └── ConfigError             500  the server's own configuration is unusable (e.g. a
                                     weak API key); it refuses to start
"""

from __future__ import annotations

from typing import Any


class HangarError(Exception):
    """Base of every error Hangar raises on purpose.

    ``message`` is safe to show a user; ``context`` carries ids and figures
    (never secrets or file contents).
    """

    status: int = 500
    code: str = "internal"
    retryable: bool = False

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context


class InvalidRequest(HangarError):
    status, code = 400, "invalid_request"


class Unauthorized(HangarError):
    status, code = 401, "unauthorized"


class Unavailable(HangarError):
    status, code, retryable = 503, "unavailable", True


class NotFound(HangarError):
    status, code = 404, "not_found"


class Gone(HangarError):
    status, code = 410, "gone"


class Conflict(HangarError):
    status, code = 409, "conflict"


class Busy(Conflict):
    code, retryable = "busy", True


class ImageMissing(Conflict):
    """The exact image build that a sandbox, snapshot or machine was made from (its
    pinned id, ``<name>-<digest>``) no longer exists, so it cannot be restored or woken:
    another build's bytes under its disk would corrupt its filesystem. Not retryable."""

    code = "image_missing"


class TooLarge(HangarError):
    status, code = 413, "too_large"


class LimitExceeded(HangarError):
    status, code, retryable = 429, "limit_exceeded", True

    def __init__(self, message: str, retry_after: float = 1.0, **context: Any) -> None:
        super().__init__(message, retry_after=retry_after, **context)
        self.retry_after = retry_after


class Timeout(HangarError):
    status, code, retryable = 504, "timeout", True


class GuestError(HangarError):
    status, code = 502, "guest_error"


class EngineError(HangarError):
    status, code = 500, "engine_error"


class ImageError(HangarError):
    status, code = 500, "image_error"


class ConfigError(HangarError):
    status, code = 500, "config_error"


BY_CODE: dict[str, type[HangarError]] = {
    cls.code: cls
    for cls in (
        HangarError, InvalidRequest, Unauthorized, Unavailable, NotFound, Gone, Conflict, Busy,
        ImageMissing, TooLarge, LimitExceeded, Timeout, GuestError, EngineError, ImageError,
        ConfigError,
    )
}
