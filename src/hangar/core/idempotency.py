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

from sqlalchemy import Engine, Float, Integer, LargeBinary, String, delete
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

SEALED = b"hs1:"
"""Prefix of a sealed body: version 1 (12-byte nonce, then AES-GCM's ciphertext and tag)."""
TTL_S = 24 * 3600.0
"""Seconds a key is remembered (the agent platforms' contract: 24 h)."""
MAX_KEY_LEN = 255


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
    """The answer, sealed (``seal``)."""
    created_at: Mapped[float] = mapped_column(Float, index=True)


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

    def __init__(self, engine: Engine, ttl_s: float = TTL_S) -> None:
        self.ttl_s = ttl_s
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
        """Remember an answer (replacing an expired record of the key) and purge old ones."""
        now = time.time()
        with self._session() as s, s.begin():
            s.execute(delete(IdempotencyRecord).where(
                IdempotencyRecord.created_at < now - self.ttl_s))
            s.merge(IdempotencyRecord(owner=owner, key=key, request_hash=req_hash, status=status,
                                      content_type=content_type, body=body, created_at=now))
