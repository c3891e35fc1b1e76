"""The cluster secret: where it comes from, and the signatures (MACs) made and checked with it.

KV block headers and tickets (:mod:`orchestrator.kv.wire`), every request to an
internal model (``prefill``, ``decode``, the frontend's ``orchestrator``) and every
call to a controller or replica service are signed with the one secret the
cluster shares. The secret comes from a file (``secret_file``, mode 0600, under
the run folder: ``dejavu up`` writes it) or from ``DEJAVU_SECRET`` (hex); it is
never a model-config parameter, so no config endpoint can show it.

A request signature is ``<unix ms>:<nonce>:<hex MAC>`` over the time, the nonce and
the whole request: for an internal model its model, op, request id, target node and
every input tensor (:func:`request_parameters`); for an RPC its method and body. A
receiver checks it with a :class:`Verifier`: older or newer than ``WINDOW_S``, made
before the receiver started, or seen before, it is refused.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ENV = "DEJAVU_SECRET"
MAC_BYTES = 32
MAC_KEY_BYTES = 64  # BLAKE2b's longest key: a longer secret is hashed to one
UMASK = 0o077  # every file, folder and region a cluster process makes: its user's alone
# A signature's life: a receiver keeps each nonce this long to refuse it again. Loopback or
# NTP-synchronised clocks; long enough for a call queued in Triton behind a busy P-node.
WINDOW_S = 20.0
CLOCK_STEP_S = 1.0  # time.time() of two processes may differ this much
NONCE_BYTES = 16
# Preprocessing's signature of a prompt, checked by the frontend's orchestrator model after
# its entry queue: it binds the ids to the ensemble's run; a copy gains its holder nothing
# the public ensemble does not give.
PROMPT_MAX_AGE_S = 300.0
REPLAY_CAPACITY = 200_000  # nonces held at most (20,000 signed requests/s over the window)


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


def open_private(path: Path, mode: str = "w"):  # noqa: ANN201  (a file object)
    """``open(path, mode)`` ("w", "a", "wb", "ab") of a file only its owner may read or write,
    whatever the process's umask (the cluster's files are made in processes that keep
    theirs, such as a test run; the children get UMASK at their Popen)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    return os.fdopen(fd, mode)


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


def _body(parts: tuple[str | bytes, ...]) -> bytes:
    encoded = [p.encode() if isinstance(p, str) else p for p in parts]
    # Length-prefixed: ("ab", "c") and ("a", "bc") sign differently.
    return b"".join(len(p).to_bytes(4, "big") + p for p in encoded)


def sign(secret: bytes, *parts: str | bytes, now: float | None = None) -> str:
    """A signature of ``parts`` for now, with a fresh nonce: ``<ms>:<nonce>:<MAC>``."""
    issued_ms = str(int((time.time() if now is None else now) * 1000))
    nonce = os.urandom(NONCE_BYTES).hex()
    return f"{issued_ms}:{nonce}:{mac(secret, _body((issued_ms, nonce, *parts))).hex()}"


def verify(secret: bytes, signature: str | None, *parts: str | bytes,
           max_age_s: float = WINDOW_S, now: float | None = None) -> tuple[float, str]:
    """Raises :class:`Unauthenticated` unless ``signature`` signs ``parts`` and is fresh;
    returns its (issue time, nonce). Stateless: a receiver that must refuse a replay checks
    with a :class:`Verifier`."""
    if not signature:
        raise Unauthenticated("unsigned request: internal surfaces demand the cluster secret")
    try:
        issued_ms, nonce, digest = signature.split(":")
        issued_at, given = int(issued_ms) / 1000, bytes.fromhex(digest)
    except ValueError:
        raise Unauthenticated("malformed request signature") from None
    if not hmac.compare_digest(given, mac(secret, _body((issued_ms, nonce, *parts)))):
        raise Unauthenticated("bad request signature: not made with the cluster secret")
    age = (time.time() if now is None else now) - issued_at
    if abs(age) > max_age_s:
        raise Unauthenticated(f"stale request signature ({age:.1f} s old)")
    return issued_at, nonce


class Verifier:
    """A receiver's check: each signature valid, fresh (``window_s``), made after this
    receiver started (a restarted node, whose cache is empty, refuses what was signed for its
    former incarnation) and seen once (a replay cache of the window's nonces, at most
    ``capacity``: when full of live nonces it refuses rather than forget one)."""

    def __init__(self, secret: bytes, target: str = "", window_s: float = WINDOW_S,
                 capacity: int = REPLAY_CAPACITY, clock: Callable[[], float] = time.time
                 ) -> None:
        """``target``: this receiver as its callers name it (a node's gRPC address), signed
        into every request to it, so a request to one node is refused by another."""
        self.secret, self.target, self.window_s = secret, target, window_s
        self.capacity, self.clock = capacity, clock
        self.started = clock()
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # heap: when each seen nonce may go
        self._lock = threading.Lock()

    def verify(self, signature: str | None, *parts: str | bytes) -> None:
        now = self.clock()
        issued_at, nonce = verify(self.secret, signature, *parts, max_age_s=self.window_s,
                                  now=now)
        if issued_at < self.started - CLOCK_STEP_S:
            raise Unauthenticated("request signed before this receiver started")
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if nonce in self._seen:
                raise Unauthenticated("replayed request signature")
            if len(self._seen) >= self.capacity:
                raise Unauthenticated("too many signed requests in the window; try again")
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (issued_at + self.window_s, nonce))

    def check_request(self, parameters: str, model: str, op: str, request_id: str,
                      tensors: Mapping[str, Any]) -> None:
        """Raises :class:`Unauthenticated` unless the request's parameters (Triton's JSON of
        them) carry a fresh, unseen signature of the whole request (:func:`request_parameters`)."""
        try:
            signature = json.loads(parameters or "{}").get("auth")
        except (ValueError, AttributeError):
            signature = None
        self.verify(signature if isinstance(signature, str) else None,
                    *_request_parts(model, op, request_id, self.target, tensors))


def _tensor_bytes(array: Any) -> tuple[bytes, bytes]:  # noqa: ANN401  (a numpy array)
    """(dtype, data) of one tensor as both ends see it: BYTES elements length-prefixed (as
    Triton sends them), numbers in their dtype's byte order."""
    if array.dtype.kind in "OSU":
        items = [v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)]
        return b"BYTES", b"".join(len(v).to_bytes(4, "little") + v for v in items)
    return array.dtype.str.encode(), array.tobytes()


def _request_parts(model: str, op: str, request_id: str, target: str,
                   tensors: Mapping[str, Any]) -> list[str | bytes]:
    parts: list[str | bytes] = [model, op, request_id, target]
    for name in sorted(tensors):
        dtype, data = _tensor_bytes(tensors[name])
        parts += [name, dtype, ",".join(map(str, tensors[name].shape)), data]
    return parts


def request_parameters(secret: bytes, model: str, op: str, request_id: str, target: str,
                       tensors: Mapping[str, Any]) -> dict[str, str]:
    """The Triton request parameters that sign a whole request to an internal model:
    ``model``, ``op``, the request id, ``target`` (the node's gRPC address) and every input
    tensor (name -> numpy array), with a time and a nonce."""
    return {"auth": sign(secret, *_request_parts(model, op, request_id, target, tensors))}


def sign_prompt(secret: bytes, prompt_ids: bytes) -> str:
    """Preprocessing's signature of the token ids it made (the ensemble hands it on), so
    the frontend's ``orchestrator`` model serves the ensemble only, not direct calls."""
    return sign(secret, "orchestrator", "prompt", prompt_ids)


def check_prompt(secret: bytes, signature: str | None, prompt_ids: bytes) -> None:
    verify(secret, signature, "orchestrator", "prompt", prompt_ids, max_age_s=PROMPT_MAX_AGE_S)
