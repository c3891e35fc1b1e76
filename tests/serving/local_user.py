"""What another local user of the host does to a cluster, run as that user
(:func:`run_as_local_user`): ``restricted`` reads every ``/proc/<pid>/cmdline`` and
``environ`` it can and calls every restricted Triton API of the given servers with each
header rule it found, exactly as found, over raw HTTP/1.1 and HTTP/2 and through the gRPC
client; ``watch`` polls /dev/shm every millisecond and holds open every region it can, until
told to stop, then reads them all for a marker. Prints one JSON report."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

USER = "probe"
HERE = Path(__file__).resolve().parent

# (method, path, body) of each restricted HTTP API; an internal node's extra ones after.
HTTP_PUBLIC = [("POST", "/v2/systemsharedmemory/region/x/register", "REGISTER"),
               ("GET", "/v2/systemsharedmemory/status", None),
               ("POST", "/v2/logging", {"log_verbose_level": 1}),
               ("GET", "/v2/logging", None),
               ("GET", "/v2/trace/setting", None),
               ("POST", "/v2/repository/index", {}),
               ("POST", "/v2/repository/models/ensemble/unload", {})]
HTTP_INTERNAL = [("GET", "/v2", None), ("GET", "/v2/models/MODEL/config", None),
                 ("GET", "/v2/models/stats", None)]


# -- as the test's user ----------------------------------------------------------------------

def local_user() -> str:
    """The unprivileged user the probes run as, made if missing (needs root)."""
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", USER], check=True)
    return USER


def run_as_local_user(*args: str, timeout_s: float = 120.0) -> subprocess.Popen:
    """This file's ``args`` command as :data:`USER`, its report on stdout."""
    return subprocess.Popen([shutil.which("runuser") or "runuser", "-u", local_user(), "--",
                             sys.executable, str(Path(__file__).resolve()), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd="/", stdin=subprocess.PIPE)


# -- as the local user -----------------------------------------------------------------------

def what_proc_shows() -> tuple[list[tuple[str, str]], dict]:
    """Every restricted-API header rule (key, value) in a readable command line, tried also
    with every value of a readable environment; and how many of each it read."""
    rules, values, read = set(), set(), {"cmdline": 0, "environ": 0}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        for name in ("cmdline", "environ"):
            try:
                data = (entry / name).read_bytes()
            except OSError:
                continue
            read[name] += bool(data)
            for item in data.decode(errors="surrogateescape").split("\0"):
                if name == "environ":
                    values.add(item.partition("=")[2])
                for flag in ("--http-restricted-api=", "--grpc-restricted-protocol="):
                    if item.startswith(flag):
                        key, _, value = item.removeprefix(flag).partition(":")[2].partition("=")
                        rules.add((key, value))
    found = sorted(rules | {(key, value) for key, _ in rules for value in values if value})
    return found, read


def http_raw(port: int, method: str, path: str, body: bytes, header: bytes) -> int:
    """The status of one HTTP/1.1 request sent byte for byte (0: the server closed it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                  f"Content-Length: {len(body)}\r\n".encode() + header + b"\r\n" + body)
        reply = b""
        while b"\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                return 0
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def _hpack_int(value: int) -> bytes:
    if value < 127:
        return bytes([value])
    out, value = [127], value - 127
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    return bytes([*out, value])


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + struct.pack(">I", stream) \
        + payload


def grpc_raw(port: int, method: str, message: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
    """One gRPC call over a hand-made HTTP/2 connection, its headers as literal HPACK
    fields byte for byte (no client library checks them): True if it got a message back."""
    fields = [(b":method", b"POST"), (b":scheme", b"http"),
              (b":path", f"/inference.GRPCInferenceService/{method}".encode()),
              (b":authority", b"127.0.0.1"), (b"content-type", b"application/grpc"),
              (b"te", b"trailers"), *headers]
    block = b"".join(b"\0" + _hpack_int(len(k)) + k + _hpack_int(len(v)) + v for k, v in fields)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"")
                  + _frame(1, 4, 1, block)
                  + _frame(0, 1, 1, b"\0" + struct.pack(">I", len(message)) + message))
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                return False
            if not chunk:
                return False
            data += chunk
            while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
                length, kind, flags = int.from_bytes(data[:3], "big"), data[3], data[4]
                stream = int.from_bytes(data[5:9], "big") & 0x7FFFFFFF
                data = data[9 + length:]
                if stream == 1 and kind == 0:  # DATA: the call was served
                    return True
                if (stream == 1 and kind == 1 and flags & 1) or kind in (3, 7):
                    return False  # trailers only, RST_STREAM or GOAWAY


def _field(number: int, value: str | int) -> bytes:
    """One protobuf field: a string, or a varint."""
    if isinstance(value, int):
        out = bytearray([number << 3])
        while True:
            out.append((value & 127) | (128 if value > 127 else 0))
            value >>= 7
            if not value:
                return bytes(out)
    raw = value.encode()
    return bytes([number << 3 | 2]) + _hpack_int(len(raw)) + raw


def grpc_calls(model: str, region: str, internal: bool) -> list[tuple[str, bytes]]:
    """Each restricted gRPC method with a request it would serve (a message back)."""
    calls = [("SystemSharedMemoryRegister", _field(1, "x") + _field(2, f"/{region}")
              + _field(4, 64)),
             ("SystemSharedMemoryStatus", b""), ("LogSettings", b""), ("TraceSetting", b""),
             ("RepositoryIndex", b"")]
    if internal:
        calls += [("ServerMetadata", b""), ("ModelMetadata", _field(1, model)),
                  ("ModelConfig", _field(1, model)), ("ModelStatistics", b"")]
    return calls


def client_refusals(grpc_url: str, region: str, model: str, internal: bool) -> list[str]:
    """Each restricted API called through tritonclient without a header: the messages
    (each must say it is restricted; gRPC UNAVAILABLE)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(grpc_url)
    calls = [(client.register_system_shared_memory, ("x", f"/{region}", 64)),
             (client.get_system_shared_memory_status, ()),
             (client.update_log_settings, ({"log_verbose_level": 1},)),
             (client.get_log_settings, ()), (client.get_trace_settings, ()),
             (client.get_model_repository_index, ()), (client.unload_model, ("ensemble",))]
    if internal:
        calls += [(client.get_server_metadata, ()), (client.get_model_config, (model,)),
                  (client.get_inference_statistics, ())]
    out = []
    try:
        for call, args in calls:
            try:
                call(*args)
                out.append(f"{call.__name__}: SERVED")
            except InferenceServerException as exc:
                out.append(f"{call.__name__}: {exc.status()} {exc.message()}")
    finally:
        client.close()
    return out


def restricted(servers: list[dict], region: str) -> dict:
    """Every restricted API of ``servers`` ({http, grpc, model, internal}) with every rule
    /proc shows, sent as is (and with a line feed folded as an HTTP/1.1 continuation)."""
    rules, read = what_proc_shows()
    served, tried, controls, plain = [], 0, [], set()
    for server in servers:
        http, grpc = (int(server[k].rsplit(":", 1)[1]) for k in ("http", "grpc"))
        internal, model = server["internal"], server["model"]
        controls += [http_raw(http, "GET", "/v2/health/ready", b"", b"") == 200,
                     grpc_raw(grpc, "ServerLive", b"", [])]
        headers = [b""] + [f"{key}: {text}\r\n".encode(errors="surrogateescape")
                           for key, value in rules
                           for text in (value, value.replace("\n", "\r\n "))]
        for method, path, body in HTTP_PUBLIC + (HTTP_INTERNAL if internal else []):
            if body == "REGISTER":
                body = {"key": f"/{region}", "offset": 0, "byte_size": 64}
            raw = b"" if body is None else json.dumps(body).encode()
            for header in headers:
                tried += 1
                status = http_raw(http, method, path.replace("MODEL", model), raw, header)
                if not header:
                    plain.add(status)
                if 200 <= status < 300:
                    served.append(f"HTTP {server['http']} {method} {path} {header!r}")
        for method, message in grpc_calls(model, region, internal):
            for key, value in [(None, None), *rules]:
                for prefix in ("triton-grpc-protocol-", ""):
                    if key is None and prefix:
                        continue
                    tried += 1
                    sent = [] if key is None else [
                        ((prefix + key).encode(), value.encode(errors="surrogateescape"))]
                    if grpc_raw(grpc, method, message, sent):
                        served.append(f"gRPC {server['grpc']} {method} {sent!r}")
    refusals = [line for s in servers
                for line in client_refusals(s["grpc"], region, s["model"], s["internal"])]
    return {"rules": rules, "read": read, "tried": tried, "served": served,
            "controls": controls, "http_without_header": sorted(plain), "client": refusals}


def watch(marker: str, stop_file: str, ready_file: str, *prefixes: str) -> dict:
    """Poll /dev/shm every millisecond for regions named ``prefixes*`` and keep open every
    one it can, until ``stop_file`` exists; then read each one it holds for ``marker``."""
    held: dict[str, int] = {}
    seen: set[str] = set()
    Path(ready_file).touch()
    polls = 0
    while not os.path.exists(stop_file):
        polls += 1
        for name in os.listdir("/dev/shm"):
            if not name.startswith(prefixes) or name in held:
                continue
            seen.add(name)
            with contextlib.suppress(OSError):  # not ours to open, or gone
                held[name] = os.open(f"/dev/shm/{name}", os.O_RDONLY)
        time.sleep(0.001)
    found = []
    for name, fd in held.items():
        if marker.encode() in os.pread(fd, os.fstat(fd).st_size, 0):
            found.append(name)
        os.close(fd)
    return {"polls": polls, "seen": sorted(seen), "opened": sorted(held),
            "marker_in": sorted(found)}


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    run = {"restricted": lambda: restricted(json.loads(rest[0]), rest[1]),
           "watch": lambda: watch(*rest)}[command]
    print(json.dumps(run()))
