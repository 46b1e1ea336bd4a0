"""Hangar's error hierarchy.

Errors are classed by what the caller should do, and each maps to one HTTP
status in the REST API (``hangar.api.errors``) and back to the same class in
the client SDK (``hangar.client``)::

    HangarError                      base; ``context`` holds ids and figures
    ├── InvalidRequest          400  fix the request (bad path, bad key name)
    │   └── IdempotencyMismatch 422  an Idempotency-Key reused with another request
    ├── Unauthorized            401  no or wrong API key
    ├── Forbidden               403  the credential given (or none) does not open this
    ├── Unavailable             503  the server could not be reached (client side; retry)
    ├── NotFound                404  no such sandbox, file or image
    ├── Gone                    410  the sandbox existed but expired
    ├── Conflict                409  the object's state forbids the call now
    │   ├── Busy                409  retryable after ``retry_after`` seconds
    │   ├── Deleting            409  the sandbox is already being deleted (E2B: 404)
    │   ├── ImageMissing        409  the image build a sandbox or snapshot pins is gone
    │   ├── DiskFull            409  the guest's file system is full (or over quota);
    │   │                            free space in it first; not retryable as is
    │   └── VolumeCorrupt       409  a named volume's filesystem is damaged (a guest
    │                                wrote over it): repair it (``hangar volume fsck``)
    ├── TooLarge                413  the request body is over the server's limit
    ├── LimitExceeded           429  retryable after ``retry_after`` seconds
    │   └── QuotaExceeded       429  a team's limit: not retryable as is (free what the
    │                                team holds, or raise the limit); no Retry-After
    ├── Timeout                 504  the guest did not answer in time (it is marked
    │                                ``unresponsive``); retryable
    │   └── RequestTimeout           client side: no answer within the call's timeout
    ├── GuestError              502  the guest agent reported a failure
    ├── EngineError             500  the VMM failed (boot, QMP, process died)
    ├── ImageError              500  building or finding a guest image failed
    └── ConfigError             500  the server's own configuration is unusable (e.g. a
                                     weak API key); it refuses to start

``retryable`` says whether the same call may succeed if tried again.
``outcome_unknown`` is true when the call may or may not have taken effect:
the connection failed or timed out after the request was sent (client
side). Reconcile before repeating such a call, unless it is safe to repeat
(a read, a delete, a file write, or a create with an ``Idempotency-Key``,
which the SDK sends and the server honours).
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
    outcome_unknown: bool = False

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context


class InvalidRequest(HangarError):
    status, code = 400, "invalid_request"


class IdempotencyMismatch(InvalidRequest):
    """The ``Idempotency-Key`` was first used with another method, path or body (422)."""

    status, code = 422, "idempotency_mismatch"


class Unauthorized(HangarError):
    status, code = 401, "unauthorized"


class Forbidden(HangarError):
    """The request is understood but the credential it carries (or none) does not open
    what it asks for: E2B's answer for a private sandbox URL without its traffic token."""

    status, code = 403, "forbidden"


class Unavailable(HangarError):
    """The server could not be reached, or the connection broke (client side).

    ``outcome_unknown`` is true when the connection broke after the request
    had been sent: the server may have acted on it.
    """

    status, code, retryable = 503, "unavailable", True

    def __init__(self, message: str, outcome_unknown: bool = False, **context: Any) -> None:
        super().__init__(message, **context)
        self.outcome_unknown = outcome_unknown


class NotFound(HangarError):
    status, code = 404, "not_found"


class Gone(HangarError):
    status, code = 410, "gone"


class Conflict(HangarError):
    status, code = 409, "conflict"


class Busy(Conflict):
    """Retryable: the object is between states or has a call in flight. The REST
    answer carries ``Retry-After`` (``retry_after`` seconds)."""

    code, retryable = "busy", True

    def __init__(self, message: str, retry_after: float = 1.0, **context: Any) -> None:
        super().__init__(message, retry_after=retry_after, **context)
        self.retry_after = retry_after


class Deleting(Conflict):
    """A delete of a sandbox that is already being deleted: nothing to retry. E2B's API,
    whose killed sandbox is gone at once, answers 404 for it."""

    code = "deleting"


class ImageMissing(Conflict):
    """The exact image build that a sandbox, snapshot or machine was made from (its
    pinned id, ``<name>-<digest>``) no longer exists, so it cannot be restored or woken:
    another build's bytes under its disk would corrupt its filesystem. Not retryable."""

    code = "image_missing"


class DiskFull(Conflict):
    """The guest's file system has no room for the write (ENOSPC, or EDQUOT: over quota).

    The sandbox's state, not the server, is at fault, and the same call fails
    the same way until the caller frees space (delete files) or uses a sandbox
    with a larger disk: 409, never retried. ``context`` names the ``path`` and
    the ``free_bytes`` and ``total_bytes`` of its file system (as the guest's
    ``statvfs`` counts them for an unprivileged writer; absent when the guest
    could not say)."""

    code = "disk_full"


class VolumeCorrupt(Conflict):
    """A named volume's ext4 filesystem is damaged (a guest may write anything to its
    drive, its superblock included), so a create cannot mount it and the host cannot
    read it. The volume's data, not the server, is at fault: 409, never retried; the
    message names the volume and the repair (``hangar volume fsck NAME``, ``POST
    /volumes/{id}/fsck``); ``context`` holds ``volume_id``, ``volume`` (its name) and
    ``repair``."""

    code = "volume_corrupt"


class NoInterpreter(Conflict):
    """A code interpreter call to a sandbox that runs none (an image other than
    ``code-interpreter``: nothing listens on its port 49999)."""

    code = "no_interpreter"


class TooLarge(HangarError):
    status, code = 413, "too_large"


class LimitExceeded(HangarError):
    status, code, retryable = 429, "limit_exceeded", True

    def __init__(self, message: str, retry_after: float = 1.0, **context: Any) -> None:
        super().__init__(message, retry_after=retry_after, **context)
        self.retry_after = retry_after


class QuotaExceeded(LimitExceeded):
    """A team's quota (``hangar.core.teams``): waiting does not help, so no ``retry_after``
    (no ``Retry-After`` header) and not retried by the SDK."""

    code, retryable = "quota_exceeded", False

    def __init__(self, message: str, **context: Any) -> None:
        HangarError.__init__(self, message, **context)
        self.retry_after = None  # type: ignore[assignment]


class Timeout(HangarError):
    status, code, retryable = 504, "timeout", True


class RequestTimeout(Timeout):
    """No answer within the call's timeout (client side; ``timeout_s`` in ``context``).

    ``outcome_unknown`` is false when the request was never sent (the
    connection could not be made in time), true when the server may have
    acted on it.
    """

    code = "request_timeout"

    def __init__(self, message: str, outcome_unknown: bool = True, **context: Any) -> None:
        super().__init__(message, **context)
        self.outcome_unknown = outcome_unknown


class GuestError(HangarError):
    status, code = 502, "guest_error"


class BootStalled(GuestError):
    """A cold boot that can never finish: the guest's kernel runs without a timer.

    Seen under emulation on a host whose CPU is contended: when the vCPU
    is descheduled for 100 ms or more just as the guest kernel calibrates
    its local APIC timer against the TSC, the calibration window shrinks to
    microseconds, the kernel judges the timer too slow and disables it, and
    a one-vCPU microVM has no other tick (``hangar.engines.qemu.stall``).
    The core boots such a sandbox again (``hangar.engines.base.again_if_stalled``,
    ``BOOT_ATTEMPTS`` boots in all) before it gives up with this error.
    """

    code = "boot_stalled"


class EngineError(HangarError):
    status, code = 500, "engine_error"


class ImageError(HangarError):
    status, code = 500, "image_error"


class ConfigError(HangarError):
    status, code = 500, "config_error"


BY_CODE: dict[str, type[HangarError]] = {
    cls.code: cls
    for cls in (
        HangarError, InvalidRequest, IdempotencyMismatch, Unauthorized, Forbidden, Unavailable,
        NotFound,
        Gone, Conflict, Busy, Deleting, ImageMissing, DiskFull, VolumeCorrupt, NoInterpreter,
        TooLarge, LimitExceeded, QuotaExceeded,
        Timeout, RequestTimeout, GuestError, BootStalled, EngineError, ImageError, ConfigError,
    )
}
