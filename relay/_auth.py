"""Job authentication: an HMAC-SHA256 over every message's header frame.

The launcher puts a per-job secret in ``RELAY_JOB_SECRET`` (hex); a local root generates one
and passes it to the processes it spawns. A process outside the job may instead name a file
holding the secret in ``RELAY_JOB_SECRET_FILE``. Every message is ``[mac, header, *buffers]``
where ``mac = HMAC(secret, header || sizes of the buffer frames)``. A message whose MAC does
not verify is dropped and counted. Buffer *contents* are covered only when
``RELAY_MAC_PAYLOAD=1`` (off by default: hashing bulk tensors would halve bulk bandwidth;
their sizes are always covered, so frames cannot be added, dropped or resized).

The handshake (relay/_calls.py, ``CallTable.authenticate``): a process that attaches to
another can send an authenticated hello and wait for its MAC'd ack, which echoes a fresh
nonce; a hello that does not verify gets :data:`AUTH_REJECTED` (rate-limited by
:class:`TokenBucket`), every other unauthenticated message gets nothing.
"""

from __future__ import annotations

import hmac
import os
import secrets
import struct
import time

from ._settings import settings

SECRET_ENV = "RELAY_JOB_SECRET"
SECRET_FILE_ENV = "RELAY_JOB_SECRET_FILE"
MAC_SIZE = 32
# The whole answer to a hello that does not verify. Constant, carries no data, shorter
# than any hello (a hello is at least MAC_SIZE + 20 bytes), and shorter than MAC_SIZE + 1,
# so it can never be mistaken for a signed message.
AUTH_REJECTED = b"relay: not authenticated"

_generated: str | None = None  # the secret this process made up, when it had none
_from_file: tuple[str, str] | None = None  # (path, secret) when read from RELAY_JOB_SECRET_FILE


def secret_hex() -> str:
    """The job's secret as hex: ``RELAY_JOB_SECRET``, else the file named by
    ``RELAY_JOB_SECRET_FILE`` (read once), else one this process made up (once). Writes no
    environment: a spawner passes it to its workers in theirs."""
    global _generated, _from_file
    cfg = settings()
    if cfg.job_secret:
        return cfg.job_secret
    path = cfg.job_secret_file
    if path:
        if _from_file is None or _from_file[0] != path:
            _from_file = (path, read_secret_file(path))
        return _from_file[1]
    if _generated is None:
        _generated = secrets.token_hex(32)
    return _generated


def _key(value: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(
            f"{SECRET_ENV} must be a hex string (e.g. from: python -c 'import secrets; print(secrets.token_hex(32))')"
        ) from None


def job_secret() -> bytes:
    """Settle this process's job secret and return it: ``RELAY_JOB_SECRET``, else the file
    named by ``RELAY_JOB_SECRET_FILE``, else one generated here. It is exported as
    ``RELAY_JOB_SECRET``, so every process started from here inherits it. Raises ValueError
    (saying what to change) for a value that is not hex or a file that cannot be read."""
    value = secret_hex()
    key = _key(value)
    os.environ[SECRET_ENV] = value
    return key


def read_secret_file(path: str) -> str:
    """The hex secret held by ``path`` (surrounding whitespace ignored); a clear error
    naming ``RELAY_JOB_SECRET_FILE`` when it cannot be read or is not hex."""
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError as e:
        raise ValueError(f"{SECRET_FILE_ENV}={path}: cannot read the secret file ({e.strerror})") from None
    try:
        bytes.fromhex(value)
    except ValueError:
        value = ""
    if not value:
        raise ValueError(f"{SECRET_FILE_ENV}={path}: the file must hold the job's secret as one hex string")
    return value


def write_secret_file(path: str, value: str) -> None:
    """Write ``value`` to ``path`` readable by this user only (mode 0600, also when the
    file existed with another mode); its directory is created with mode 0700."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (value + "\n").encode())
    finally:
        os.close(fd)


def secret_origin() -> str:
    """Where this process's secret comes from, in words, for error messages."""
    cfg = settings()
    value = cfg.job_secret
    from_file = f"this process's secret comes from {SECRET_FILE_ENV}={_from_file[0]}" if _from_file else ""
    if value and value != _generated:
        if _from_file is not None and _from_file[1] == value:
            return from_file
        return f"this process's secret comes from {SECRET_ENV}"
    if not value and cfg.job_secret_file and _from_file is not None:
        return from_file
    return f"this process has no {SECRET_ENV} (nor {SECRET_FILE_ENV}), so it made up a secret of its own"


def secret_advice() -> str:
    return (
        f"Give this process the server's secret before it starts: export {SECRET_ENV}=<the server's hex secret>, "
        f"or {SECRET_FILE_ENV}=<a file holding it>"
    )


class TokenBucket:
    """At most ``burst`` events at once and ``rate`` per second on average."""

    __slots__ = ("rate", "burst", "_tokens", "_at")

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self._tokens, self._at = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False


class Signer:
    __slots__ = ("_key", "_payload")

    def __init__(self, key: bytes | None = None):
        self._key = key if key is not None else _key(secret_hex())
        self._payload = settings().mac_payload

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
