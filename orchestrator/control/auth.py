"""The cluster secret: where it comes from, and the signatures (MACs) made and checked with it.

KV block headers and tickets (:mod:`orchestrator.kv.wire`), every request to an
internal model (``prefill``, ``decode``, the frontend's ``orchestrator``) and every
call to a controller or replica service are signed with the one secret the
cluster shares. The secret comes from a file (``secret_file``, mode 0600, under
the run folder: ``dejavu up`` writes it) or from ``DEJAVU_SECRET`` (hex); it is
never a model-config parameter, so no config endpoint can show it.

A request signature is ``<unix time>:<hex MAC>`` over the time and the parts
that say what is asked (a model and operation and request id, or an RPC method
and its body); a signature older or newer than ``max_age_s`` is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import time
from pathlib import Path

ENV = "DEJAVU_SECRET"
MAC_BYTES = 32
MAC_KEY_BYTES = 64  # BLAKE2b's longest key: a longer secret is hashed to one
MAX_AGE_S = 300.0  # loopback or NTP-synchronised clocks; bounds a replay's window


class Unauthenticated(PermissionError):
    """A request without a valid signature of the cluster secret."""


def mac(secret: bytes, body: bytes) -> bytes:
    """The MAC of ``body`` keyed by the cluster secret: keyed BLAKE2b, 32 bytes (RFC 7693).
    Not HMAC-SHA256: OpenSSL looks its algorithm up on every call, which cost ~40 us on a
    T-node right after an engine step had evicted it from the caches (once per token feed
    message), against ~9 us for CPython's own BLAKE2b."""
    key = secret if len(secret) <= MAC_KEY_BYTES else hashlib.blake2b(secret).digest()
    return hashlib.blake2b(body, key=key, digest_size=MAC_BYTES).digest()


def new_secret() -> bytes:
    return os.urandom(32)


def write_secret(path: Path, secret: bytes) -> Path:
    """Write ``secret`` (hex) readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT
        f.write(secret.hex())
    return path


def load_secret(path: str | Path | None = None) -> bytes:
    """The secret from ``path`` (refused if others may read it), else ``DEJAVU_SECRET``."""
    if path:
        path = Path(path)
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise Unauthenticated(f"secret file {path} is readable by others "
                                  f"(mode {stat.S_IMODE(mode):o}); chmod 600 it")
        text = path.read_text()
    elif os.environ.get(ENV):
        text = os.environ[ENV]
    else:
        raise Unauthenticated(f"no cluster secret: give a secret file or set {ENV}")
    secret = bytes.fromhex(text.strip())
    if len(secret) < 16:
        raise Unauthenticated("the cluster secret must be at least 16 bytes")
    return secret


def _body(issued_at: int, parts: tuple[str | bytes, ...]) -> bytes:
    encoded = [str(issued_at).encode(), *(p.encode() if isinstance(p, str) else p for p in parts)]
    # Length-prefixed: ("ab", "c") and ("a", "bc") sign differently.
    return b"".join(len(p).to_bytes(4, "big") + p for p in encoded)


def sign(secret: bytes, *parts: str | bytes, now: float | None = None) -> str:
    """A signature of ``parts`` for now."""
    issued_at = int(time.time() if now is None else now)
    return f"{issued_at}:{mac(secret, _body(issued_at, parts)).hex()}"


def verify(secret: bytes, signature: str | None, *parts: str | bytes,
           max_age_s: float = MAX_AGE_S, now: float | None = None) -> None:
    """Raises :class:`Unauthenticated` unless ``signature`` signs ``parts`` and is fresh."""
    if not signature:
        raise Unauthenticated("unsigned request: internal surfaces demand the cluster secret")
    try:
        issued, digest = signature.split(":", 1)
        issued_at, given = int(issued), bytes.fromhex(digest)
    except ValueError:
        raise Unauthenticated("malformed request signature") from None
    if not hmac.compare_digest(given, mac(secret, _body(issued_at, parts))):
        raise Unauthenticated("bad request signature: not made with the cluster secret")
    age = (time.time() if now is None else now) - issued_at
    if abs(age) > max_age_s:
        raise Unauthenticated(f"stale request signature ({age:.0f} s old)")


def request_parameters(secret: bytes, model: str, op: str, request_id: str) -> dict[str, str]:
    """The Triton request parameters that sign a request to an internal model."""
    return {"auth": sign(secret, model, op, request_id)}


def check_request(secret: bytes, parameters: str, model: str, op: str, request_id: str) -> None:
    """Raises :class:`Unauthenticated` unless the request's parameters (Triton's JSON of
    them) carry a fresh signature of (model, op, request id)."""
    try:
        signature = json.loads(parameters or "{}").get("auth")
    except (ValueError, AttributeError):
        signature = None
    verify(secret, signature if isinstance(signature, str) else None, model, op, request_id)


def sign_prompt(secret: bytes, prompt_ids: bytes) -> str:
    """Preprocessing's signature of the token ids it made (the ensemble hands it on), so
    the frontend's ``orchestrator`` model serves the ensemble only, not direct calls."""
    return sign(secret, "orchestrator", "prompt", prompt_ids)


def check_prompt(secret: bytes, signature: str | None, prompt_ids: bytes) -> None:
    verify(secret, signature, "orchestrator", "prompt", prompt_ids)
