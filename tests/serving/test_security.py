"""Issue 31's findings 1-3 and issue 44's 1-2 tried as an attacker would on a real cluster
(1 P-node, 1 T-node): Triton's shared-memory, logging, trace and repository APIs on every
port, with everything /proc shows; another local user reading the cluster's regions (from
before the cluster starts) and files; a captured internal request sent again, or with
another body."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cluster_helpers import MAX_SEQ_LEN, ids_of, module_cluster, reference
from local_user import run_as_local_user

from clients.common import PROMPTS
from clients.generate import stream_grpc, stream_http
from orchestrator.cluster.launcher import Cluster
from orchestrator.cluster.tritonserver import SHM_DIR
from orchestrator.control.auth import load_secret, request_parameters
from orchestrator.control.client import tensor
from orchestrator.control.errors import ErrorCode
from orchestrator.engine.tokenizer import load_tokenizer
from orchestrator.serving.frontend import request_arrays
from orchestrator.serving.params import GenerationParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
NOBODY = 65534


@contextmanager
def watched_up(model: Path, run_dir: Path, **kwargs) -> Iterator[Cluster]:
    """A cluster started while another local user watches /dev/shm (as root: the watcher
    runs as that user), from before its first process: ``cluster.watch`` says how to stop
    it. The watcher's control, a 0644 region holding the marker, shows it opens and reads
    what it can."""
    cluster = Cluster(model, run_dir=run_dir, max_seq_len=MAX_SEQ_LEN, **kwargs)
    cluster.watch = None
    if os.geteuid() == 0:
        marker = f"zebra{secrets.token_hex(6)}"
        control = SHM_DIR / f"dejavu_watchcontrol_{secrets.token_hex(4)}"
        control.write_text(f"a region another user may read: {marker}")
        control.chmod(0o644)
        talk = Path(tempfile.mkdtemp(prefix="dejavu-watch-"))
        talk.chmod(0o777)  # the watcher's ready mark, and the test's stop mark
        prefixes = [control.name] + [n.server.shm_prefix for n in cluster.nodes]
        process = run_as_local_user("watch", marker, str(talk / "stop"), str(talk / "ready"),
                                    *prefixes)
        deadline = time.monotonic() + 60
        while not (talk / "ready").exists():
            assert process.poll() is None and time.monotonic() < deadline, "no watcher"
            time.sleep(0.01)
        cluster.watch = {"process": process, "marker": marker, "control": control.name,
                         "stop": talk / "stop", "prefixes": prefixes[1:]}
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if cluster.watch is not None:
            cluster.watch["stop"].touch()
            cluster.watch["process"].kill()
            cluster.watch["process"].wait()
            control.unlink(missing_ok=True)
            shutil.rmtree(talk, ignore_errors=True)


cluster = module_cluster("security", up=watched_up, prefill=1, decode=1)


@pytest.fixture(scope="module")
def expected(model):
    return reference(model, PROMPTS[:1], MAX_TOKENS)


def _serves(cluster, expected) -> None:
    chunks = list(stream_grpc(cluster.frontend.grpc_url, PROMPTS[0], max_tokens=MAX_TOKENS))
    assert ids_of(chunks) == expected[0]


def _http(server, method: str, path: str, body: dict | None = None,
          headers: dict | None = None) -> int:
    request = urllib.request.Request(
        f"http://{server.http_url}{path}", method=method, headers=headers or {},
        data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def need_root() -> None:
    """The probes run as another user: only root starts them (CI runs as root)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("this check starts a process as another user: run it as root")
        pytest.skip("starts a process as another user: needs root")


MODELS = {"frontend": "ensemble", "prefill": "prefill", "decode": "decode"}


def test_no_local_user_opens_a_restricted_api_with_what_proc_shows(cluster, expected):
    """Issue 31's finding 1 and issue 44's 2: registering a shared-memory region, the log
    level, trace settings, the model repository (on internal nodes, all but inference and
    health) are refused on every node's HTTP and gRPC port to an unprivileged local user who
    read every /proc/<pid>/cmdline and environ it could and sent every header rule it found
    there, byte for byte over raw HTTP/1.1 and HTTP/2 (Triton takes the rule from argv only:
    it names a header no client can send). Health stays open; clients are still served."""
    need_root()
    servers = [{"http": n.server.http_url, "grpc": n.server.grpc_url,
                "internal": n.role != "frontend", "model": MODELS[n.role]}
               for n in cluster.nodes]
    probe = run_as_local_user("restricted", json.dumps(servers),
                              f"{cluster.frontend.shm_prefix}x")
    out, err = probe.communicate(timeout=300)
    assert probe.returncode == 0, err
    report = json.loads(out)
    assert report["read"]["cmdline"] > 0 and len(report["rules"]) >= 2  # the nodes' rules
    assert all(report["controls"])  # health answers, raw HTTP/1.1 and HTTP/2 alike
    assert report["served"] == [], report["served"]
    assert report["http_without_header"] == [403]
    assert report["client"] and all("StatusCode.UNAVAILABLE" in line and "restricted" in line
                                    for line in report["client"]), report["client"]
    _serves(cluster, expected)


def test_a_local_user_watching_dev_shm_from_before_up_opens_no_region(cluster, model,
                                                                    expected):
    """Issue 44's finding 1: a watcher, another local user polling /dev/shm every
    millisecond from before the cluster's first process, opens none of the cluster's
    regions (they live in the cluster's own /dev/shm) and reads no prompt's marker sent
    after, through the ensemble (HTTP, gRPC) and tensorrt_llm_bls."""
    need_root()
    watch = cluster.watch
    prompt = f"{PROMPTS[0]} {watch['marker']}"
    url = cluster.frontend
    for model_name in ("ensemble", "tensorrt_llm_bls"):
        assert ids_of(stream_grpc(url.grpc_url, prompt, True, model_name,
                                  max_tokens=MAX_TOKENS))
    assert ids_of(stream_http(url.http_url, prompt, False, "ensemble", max_tokens=MAX_TOKENS))
    # The prompts went through the frontend's regions: the cluster's user finds one there.
    frontend = cluster.frontend.shm_regions()
    assert any(watch["marker"].encode() in path.read_bytes() for path in frontend)
    watch["stop"].touch()
    out, err = watch["process"].communicate(timeout=120)
    assert watch["process"].returncode == 0, err
    report = json.loads(out)
    assert report["polls"] > 1000  # it watched all along the start
    assert report["opened"] == [watch["control"]]  # it opens what it can: nothing else
    assert report["marker_in"] == [watch["control"]]
    assert report["seen"] == [watch["control"]]  # the cluster's regions are not in its view
    _serves(cluster, expected)


def _cluster_files(cluster) -> list[Path]:
    run_dir = Path(cluster.run_dir)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    regions = [p for node in cluster.nodes for p in node.server.shm_regions()]
    assert run_dir / "cluster.json" in files and run_dir / "secret" in files
    assert any(p.parent.name == "logs" for p in files) and regions
    return files + regions


def test_another_local_user_reads_no_region_or_file(cluster, expected):
    """Finding 2: the run folder is 0700; its files and every node's /dev/shm region are
    0600; a process of user ``nobody`` opens none of them."""
    _serves(cluster, expected)  # the regions have held prompts
    run_dir = Path(cluster.run_dir)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    paths = _cluster_files(cluster)
    loose = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in paths
             if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO)}
    assert not loose
    # As another user: every open must fail (root, who runs the tests, bypasses modes).
    probe = ("import sys\nopened = []\nfor path in sys.argv[1:]:\n"
             "    try:\n        open(path, 'rb').read(1)\n        opened.append(path)\n"
             "    except PermissionError:\n        pass\nprint('\\n'.join(opened))\n")
    need_root()
    result = subprocess.run(["/usr/bin/python3", "-c", probe, *map(str, paths)],
                            user=NOBODY, group=NOBODY, capture_output=True, text=True,
                            timeout=30, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def _signed(url: str, model: str, request_id: str, arrays: dict, parameters: dict):
    """One request on a stream with these parameters: (result, error) of its first answer."""
    import queue

    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(model, [tensor(k, v) for k, v in arrays.items()],
                                  request_id=request_id, parameters=parameters)
        return answers.get(timeout=30)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def _code(result) -> ErrorCode:
    return ErrorCode(int(result.as_numpy("error_code")[0]))


def test_a_captured_internal_request_replayed_or_with_another_body_is_refused(
        cluster, model, expected):
    """Finding 3: the frontend's signed requests, captured on loopback: sent again they are
    refused (the nonce was seen); with another prompt, parameters or ticket, or to another
    node, their signature does not match."""
    secret = load_secret(cluster.secret_file)
    decode = cluster.role("decode")[0].server.grpc_url
    prefill = cluster.role("prefill")[0].server.grpc_url
    ids = np.array(load_tokenizer(model).encode(PROMPTS[0]).ids, dtype=np.int32)

    reserve = {"op": np.array([b"reserve"], dtype=np.object_), "input_ids": ids}
    captured = request_parameters(secret, "decode", "reserve", "captured", decode, reserve)
    result, error = _signed(decode, "decode", "captured", reserve, captured)
    assert error is None and result.as_numpy("error_code") is None  # the real one: a ticket
    release = {"op": np.array([b"release"], dtype=np.object_)}
    for _ in range(3):  # would hold a KV slot each
        result, error = _signed(decode, "decode", "captured", reserve, captured)
        assert error is None and _code(result) is ErrorCode.UNAUTHENTICATED
        assert "replayed" in result.as_numpy("error")[0].decode()
    result, _ = _signed(decode, "decode", "captured", release,
                        request_parameters(secret, "decode", "release", "captured", decode,
                                           release))
    assert result.as_numpy("error_code") is None

    generate = {**request_arrays(ids.tolist(), GenerationParams(MAX_TOKENS)),
                "kv_ticket": np.array([b"ticket"], dtype=np.object_)}
    signed = request_parameters(secret, "prefill", "prefill", "swap", prefill, generate)
    other_prompt = {**generate, "input_ids": ids[::-1].copy()}
    more_tokens = {**generate, **request_arrays(ids.tolist(), GenerationParams(200))}
    for body in (other_prompt, more_tokens,
                 {**generate, "kv_ticket": np.array([b"another"], dtype=np.object_)}):
        client = grpcclient.InferenceServerClient(prefill)
        answer = client.infer("prefill", [tensor(k, v) for k, v in body.items()],
                              request_id="swap", parameters=signed)
        client.close()
        assert _code(answer) is ErrorCode.UNAUTHENTICATED
        assert "bad request signature" in answer.as_numpy("error")[0].decode()
    swapped = request_parameters(secret, "decode", "reserve", "elsewhere", prefill, reserve)
    result, _ = _signed(decode, "decode", "elsewhere", reserve, swapped)  # for another node
    assert _code(result) is ErrorCode.UNAUTHENTICATED
    _serves(cluster, expected)
