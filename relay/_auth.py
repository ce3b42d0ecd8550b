"""Job authentication: an HMAC-SHA256 over every message's header frame.

The launcher puts a per-job secret in ``RELAY_JOB_SECRET`` (hex); a local root generates one
and passes it to the processes it spawns. Every message is ``[mac, header, *buffers]`` where
``mac = HMAC(secret, header || sizes of the buffer frames)``. A message whose MAC does not
verify is dropped and counted. Buffer *contents* are covered only when
``RELAY_MAC_PAYLOAD=1`` (off by default: hashing bulk tensors would halve bulk bandwidth;
their sizes are always covered, so frames cannot be added, dropped or resized).
"""

from __future__ import annotations

import hmac
import os
import secrets
import struct

SECRET_ENV = "RELAY_JOB_SECRET"
MAC_SIZE = 32


def job_secret() -> bytes:
    """The job's secret, generated (and exported to children) on first use if unset."""
    value = os.environ.get(SECRET_ENV)
    if not value:
        value = secrets.token_hex(32)
        os.environ[SECRET_ENV] = value
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{SECRET_ENV} must be a hex string") from None


class Signer:
    __slots__ = ("_key", "_payload")

    def __init__(self, key: bytes | None = None):
        self._key = key if key is not None else job_secret()
        self._payload = os.environ.get("RELAY_MAC_PAYLOAD", "0") == "1"

    def _mac(self, header, buffers) -> bytes:
        if not buffers:
            return hmac.digest(self._key, header, "sha256")
        h = hmac.new(self._key, header, "sha256")
        h.update(struct.pack(f"<{len(buffers)}Q", *(_nbytes(b) for b in buffers)))
        if self._payload:
            for b in buffers:
                h.update(b)
        return h.digest()

    def sign(self, header: bytes, buffers=()) -> bytes:
        return self._mac(header, buffers)

    def verify(self, mac, header, buffers=()) -> bool:
        return len(mac) == MAC_SIZE and hmac.compare_digest(mac, self._mac(header, buffers))


def _nbytes(b) -> int:
    n = getattr(b, "nbytes", None)
    return n if n is not None else len(b)
