"""Idempotency keys: results of POSTs that carried an ``Idempotency-Key``, kept 24 h.

A client that sends the same key again (its retry after a lost answer)
gets the first result instead of a second sandbox. Records are kept per
API key: ``owner`` is the SHA-256 of the API key (the key itself is never
stored), so callers with different keys never see each other's results.
``request_hash`` is the SHA-256 of the method, path, query and body; the
same key with another request is refused (422). Only successful JSON
answers are kept: a failed create left nothing, so trying it again is
right. The table lives in the server's SQLite database (``hangar.db``)
beside the sandbox records; rows older than ``ttl_s`` are ignored and
purged.

Bounds (review 29k K-M2: 3.6 MiB answers for 24 h, without limit, were a
way to fill the data folder). The API keeps an answer of at most
``hangar.api.idempotency.MAX_STORED`` bytes; of a larger one only the fact
that it ran, a record with an empty ``body`` (``kept`` false), so a repeat
is refused (409) rather than run twice. Each API key holds at most
``max_rows`` records and ``max_bytes`` of sealed answers: past either, its
oldest records are dropped (down to three quarters of both, so the trim is
rare), and a repeat of a dropped key runs as a new request. ``save`` is
blocking database work: callers on the event loop run it in a thread.

Answers can hold secrets (a private port's signed URL, a sandbox's envd
access token), so a stored answer is *sealed*: encrypted and authenticated
with AES-256-GCM (``cryptography``) under a key derived from the caller's
API key (``seal_key``: HMAC-SHA256 of the API key over a fixed label), with
the owner, the idempotency key and the request's hash as associated data.
The database, its dumps and copies hold only ciphertext; only a caller who
presents the same API key again (and so could ask for the secret anyway)
opens it. Backups leave the table out altogether (``hangar.ops.backup``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sqlalchemy import Engine, Float, Integer, LargeBinary, String, delete, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

SEALED = b"hs1:"
"""Prefix of a sealed body: version 1 (12-byte nonce, then AES-GCM's ciphertext and tag)."""
TTL_S = 24 * 3600.0
"""Seconds a key is remembered (the agent platforms' contract: 24 h)."""
MAX_KEY_LEN = 255
OWNER_ROWS = 10_000
"""Most records one API key holds: a retry comes seconds after its first try (the SDK's
after 1 s and 3 s), and 10,000 is over 15 minutes of ten keyed creates a second."""
OWNER_BYTES = 16 << 20
"""Most bytes of sealed answers one API key holds: 256 answers of the largest kept size
(64 KiB), thousands of creates' (1 to 2 KiB each); with ``OWNER_ROWS`` (a row's own
columns take under 1 KiB) under 30 MiB of the database per key."""


class Base(DeclarativeBase):
    pass


class IdempotencyRecord(Base):
    """The first successful answer to a POST with an ``Idempotency-Key``."""

    __tablename__ = "idempotency_keys"

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    """SHA-256 (hex) of the caller's API key."""
    key: Mapped[str] = mapped_column(String(MAX_KEY_LEN), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    status: Mapped[int] = mapped_column(Integer)
    content_type: Mapped[str] = mapped_column(String(128))
    body: Mapped[bytes] = mapped_column(LargeBinary)
    """The answer, sealed (``seal``); empty when it was too large to keep (``kept``)."""
    created_at: Mapped[float] = mapped_column(Float, index=True)

    @property
    def kept(self) -> bool:
        """Whether the answer is here to replay (else only the fact that it was given)."""
        return bool(self.body)


def owner_of(api_key: str) -> str:
    """The stored owner of a record: the SHA-256 of the API key, hex."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def seal_key(api_key: str) -> bytes:
    """The 32-byte key that seals the answers of callers with ``api_key``."""
    return hmac.new(api_key.encode("utf-8", "surrogatepass"), b"hangar idempotency seal v1",
                    hashlib.sha256).digest()


def _aad(owner: str, key: str, req_hash: str) -> bytes:
    return f"{owner}\0{key}\0{req_hash}".encode("utf-8", "surrogatepass")


def seal(secret: bytes, owner: str, key: str, req_hash: str, body: bytes) -> bytes:
    """``body`` encrypted and authenticated under ``secret`` (``seal_key``), bound to the
    record's owner, key and request hash."""
    nonce = os.urandom(12)
    return SEALED + nonce + AESGCM(secret).encrypt(nonce, body, _aad(owner, key, req_hash))


def unseal(secret: bytes, owner: str, key: str, req_hash: str, blob: bytes) -> bytes | None:
    """The body ``seal`` sealed, or None when ``blob`` is not one it made with ``secret``."""
    if not blob.startswith(SEALED) or len(blob) < len(SEALED) + 12 + 16:
        return None
    nonce, data = blob[len(SEALED):len(SEALED) + 12], blob[len(SEALED) + 12:]
    try:
        return AESGCM(secret).decrypt(nonce, data, _aad(owner, key, req_hash))
    except InvalidTag:
        return None


def request_hash(method: str, path: str, query: str, body: bytes) -> str:
    """What makes two requests with one key the same request."""
    h = hashlib.sha256()
    for part in (method.encode(), path.encode(), query.encode(), body):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


class IdempotencyStore:
    """Records in the server's database (its SQLAlchemy engine); one short session per call."""

    def __init__(self, engine: Engine, ttl_s: float = TTL_S, max_rows: int = OWNER_ROWS,
                 max_bytes: int = OWNER_BYTES) -> None:
        self.ttl_s = ttl_s
        self.max_rows, self.max_bytes = max_rows, max_bytes
        Base.metadata.create_all(engine)
        self._session = sessionmaker(engine, expire_on_commit=False)

    def find(self, owner: str, key: str) -> IdempotencyRecord | None:
        """The live record of ``key`` for ``owner``, or None."""
        with self._session() as s:
            rec = s.get(IdempotencyRecord, (owner, key))
        if rec is None or rec.created_at < time.time() - self.ttl_s:
            return None
        return rec

    def save(self, owner: str, key: str, req_hash: str, status: int, content_type: str,
             body: bytes) -> None:
        """Remember an answer (``body`` sealed, or empty: given but not kept), replacing an
        expired record of the key; purge expired records, and ``owner``'s oldest when it
        holds over ``max_rows`` records or ``max_bytes`` of bodies. Blocking (SQLite)."""
        now = time.time()
        rec = IdempotencyRecord.__table__.c
        with self._session() as s, s.begin():
            s.execute(delete(IdempotencyRecord).where(rec.created_at < now - self.ttl_s))
            s.merge(IdempotencyRecord(owner=owner, key=key, request_hash=req_hash, status=status,
                                      content_type=content_type, body=body, created_at=now))
            s.flush()
            rows, size = s.execute(select(func.count(), func.coalesce(func.sum(
                func.length(rec.body)), 0)).where(rec.owner == owner)).one()
            if rows > self.max_rows or size > self.max_bytes:
                self._trim(s, owner)

    def _trim(self, s: Session, owner: str) -> None:
        """Drop ``owner``'s oldest records until it holds three quarters of both bounds."""
        rec = IdempotencyRecord.__table__.c
        rows_left, bytes_left = self.max_rows * 3 // 4, self.max_bytes * 3 // 4
        drop: list[str] = []
        for key, size in s.execute(select(rec.key, func.length(rec.body)).where(
                rec.owner == owner).order_by(rec.created_at.desc())):
            rows_left, bytes_left = rows_left - 1, bytes_left - (size or 0)
            if rows_left < 0 or bytes_left < 0:
                drop.append(key)
        for i in range(0, len(drop), 500):  # SQLite's bound parameters per statement
            s.execute(delete(IdempotencyRecord).where(
                rec.owner == owner, rec.key.in_(drop[i:i + 500])))
