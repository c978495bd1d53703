"""Shard URLs: expansion, the pipe: policy, and streaming from real HTTP, S3 and GCS servers on 127.0.0.1,
directly and through a proxy that answers 5xx, drops connections or cuts bodies short on purpose."""

from __future__ import annotations

import http.client
import io
import os
import re
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from shardkit import read_all, write_shards

from mpp.data import remote
from mpp.data.module import ShardDataModule
from mpp.data.remote import ShardOpenError, check_pipe_allowed, open_url
from mpp.data.urls import expand_urls
from mpp.shards.tar import iter_files

SHARDS, PER_SHARD = 3, 4
NAMES = [f"train-{i:06d}.tar" for i in range(SHARDS)]
PATTERN = "train-{000000..000002}.tar"
BUCKET = "mpp-shards"


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("served")
    write_shards(folder, shards=SHARDS, per_shard=PER_SHARD)
    return folder


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _batches(spec: str, num_workers: int) -> tuple[list[dict], list[int]]:
    """(evaluation batches in order, sorted training labels) read through a ShardDataModule."""
    dm = ShardDataModule(train=spec, val=spec, batch_size=5, num_workers=num_workers, image_size=6)
    dm.setup("fit")
    labels, skipped, _ = read_all(dm.train_dataloader())
    assert skipped == 0
    return list(dm.val_dataloader()), sorted(labels)


def _same_as_disk(spec: str, shard_dir: Path, num_workers: int) -> None:
    remote, labels = _batches(spec, num_workers)
    local, _ = _batches(str(shard_dir / PATTERN), num_workers)
    assert labels == list(range(SHARDS * PER_SHARD))
    assert len(remote) == len(local)
    for a, b in zip(remote, local):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])


def test_expand_urls_braces_globs_lists_and_remote(shard_dir: Path) -> None:
    paths = [str(shard_dir / name) for name in NAMES]
    assert expand_urls(str(shard_dir / PATTERN)) == paths
    assert expand_urls(str(shard_dir / "train-*.tar")) == paths
    assert expand_urls([paths[0], f"file://{paths[1]}"]) == paths[:2]
    assert expand_urls("s3://b/x-{0..1}.tar") == ["s3://b/x-0.tar", "s3://b/x-1.tar"]
    with pytest.raises(ValueError, match="ftp"):
        expand_urls("ftp://host/a.tar")
    with pytest.raises(FileNotFoundError, match="train-000003.tar"):
        expand_urls(str(shard_dir / "train-{000002..000003}.tar"))


def test_pipe_urls_are_refused_unless_allowed(shard_dir: Path) -> None:
    url = f"pipe:cat {shard_dir / NAMES[0]}"
    with pytest.raises(ValueError, match="allow_pipe"):
        open_url(url)
    with pytest.raises(ValueError, match=re.escape(url)):
        check_pipe_allowed(url, allow_pipe=False)
    with open_url(url, allow_pipe=True) as stream:
        assert stream.read() == (shard_dir / NAMES[0]).read_bytes()


def _tar(format: int) -> bytes:
    """A tar in `format` with a long name, a deep path, a directory and a link, as Python writes it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=format) as tar:
        folder = tarfile.TarInfo("folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for name, data in [("a/b.png", b"x" * 700), ("n" * 150 + ".cls", b"3"), ("d/" * 60 + "e.jpg", b"")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("link.png")
        link.type, link.linkname = tarfile.SYMTYPE, "a/b.png"
        tar.addfile(link)
    return buffer.getvalue()


@pytest.mark.parametrize("format", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_reader_agrees_with_tarfile(format: int) -> None:
    data = _tar(format)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        expected = [(m.name, tar.extractfile(m).read()) for m in tar if m.isreg()]
    assert list(iter_files(io.BytesIO(data))) == expected and len(expected) == 3


def test_tar_reader_reads_ustar_prefixes_and_refuses_damage() -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("p/" * 40 + "key.png")  # over 100 characters: split into prefix + name
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    data = buffer.getvalue()
    assert list(iter_files(io.BytesIO(data))) == [("p/" * 40 + "key.png", b"abc")]
    damaged = data[:20] + b"?" + data[21:]
    for broken in (damaged, data[:1000], data[:512], b"", b"not a tar" * 100):
        with pytest.raises(tarfile.ReadError):
            list(iter_files(io.BytesIO(broken)))


class _ShardHandler(BaseHTTPRequestHandler):
    """Serves files, with Range support."""

    def do_GET(self) -> None:
        path = self.server.root / self.path.lstrip("/")
        if not path.is_file():
            self.send_error(404)
            return
        start = int(self.headers["Range"][len("bytes="):].split("-")[0]) if "Range" in self.headers else 0
        body = path.read_bytes()[start:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def http_server(shard_dir: Path) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ShardHandler)
    server.root = shard_dir
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPP_READ_RETRIES", "2")
    monkeypatch.setenv("MPP_READ_BACKOFF", "0.01")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_http_streams_the_same_samples_as_disk(http_server: ThreadingHTTPServer, shard_dir: Path,
                                               num_workers: int) -> None:
    host, port = http_server.server_address
    _same_as_disk(f"http://{host}:{port}/{PATTERN}", shard_dir, num_workers)


def test_http_errors_name_the_url(http_server: ThreadingHTTPServer, quick_retries: None) -> None:
    host, port = http_server.server_address
    missing = f"http://{host}:{port}/missing-000000.tar"
    with pytest.raises(ShardOpenError, match=re.escape(missing) + ".*404"):
        open_url(missing)
    closed = f"http://127.0.0.1:{_free_port()}/{NAMES[0]}"
    # num_workers=0: after a worker raises, torch takes 5-10 s to shut its workers down.
    dm = ShardDataModule(train=closed, batch_size=2, num_workers=0, image_size=6)
    dm.setup("fit")
    with pytest.raises(ShardOpenError, match=re.escape(closed)):
        next(iter(dm.train_dataloader()))


@pytest.fixture(scope="session")
def s3_endpoint(shard_dir: Path) -> Iterator[str]:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    for name in NAMES:
        client.upload_file(str(shard_dir / name), BUCKET, f"data/{name}")
    yield endpoint
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What a user sets for a non-AWS endpoint, and nothing from this machine's AWS setup."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_s3_streams_the_same_samples_as_disk(s3_env: None, shard_dir: Path, num_workers: int) -> None:
    _same_as_disk(f"s3://{BUCKET}/data/{PATTERN}", shard_dir, num_workers)


def test_s3_missing_object_names_the_url(s3_env: None) -> None:
    url = f"s3://{BUCKET}/data/missing-000000.tar"
    with pytest.raises(ShardOpenError, match=re.escape(url)):
        open_url(url)


@pytest.fixture(scope="session")
def gcs_endpoint(shard_dir: Path) -> Iterator[str]:
    import gcsfs
    from gcp_storage_emulator.server import create_server

    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    fs = gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon", skip_instance_cache=True)
    for name in NAMES:
        fs.pipe(f"{BUCKET}/data/{name}", (shard_dir / name).read_bytes())
    yield endpoint
    server.stop()


@pytest.fixture
def gcs_env(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_gcs_streams_the_same_samples_as_disk(gcs_env: None, shard_dir: Path, num_workers: int) -> None:
    _same_as_disk(f"gs://{BUCKET}/data/{PATTERN}", shard_dir, num_workers)


def test_gcs_missing_object_names_the_url(gcs_env: None) -> None:
    url = f"gs://{BUCKET}/data/missing-000000.tar"
    with pytest.raises(ShardOpenError, match=re.escape(url)):
        open_url(url)


# Endpoints that misbehave on purpose: a proxy in front of the shard server, moto or the GCS emulator.

class _FlakyProxy(ThreadingHTTPServer):
    """Forwards requests to `upstream`; once armed, the next requests after `after` good ones get a
    fault each: an HTTP status, "drop" (the connection closes unanswered) or "cut" (the body stops
    halfway). With `ranged`, only requests with a Range header (bucket reads) count."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = upstream.split("://", 1)[1]
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.lock = threading.Lock()
        self.arm([])

    def arm(self, faults: list[int | str], *, after: int = 0, ranged: bool = False) -> None:
        with self.lock:
            self.faults, self.after, self.ranged = list(faults), after, ranged
            self.seen: list[tuple[float, str | None, int | str | None]] = []  # (time, Range, fault) per request

    def fault_for(self, headers: Any) -> int | str | None:
        with self.lock:
            if self.ranged and "Range" not in headers:
                return None
            fault = self.faults.pop(0) if self.faults and len(self.seen) >= self.after else None
            self.seen.append((time.monotonic(), headers.get("Range"), fault))
            return fault

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the client hung up on a dropped or cut response: that is the point


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fault = self.server.fault_for(self.headers)
        if fault == "drop":
            self.close_connection = True
            return
        if isinstance(fault, int):
            self.send_response(fault)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=10)
        upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
        response = upstream.getresponse()
        data = response.read()
        upstream.close()
        self.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in ("connection", "transfer-encoding", "content-length"):
                self.send_header(name, value)
        self.send_header("Content-Length", response.getheader("Content-Length", str(len(data))))
        self.end_headers()
        if fault == "cut":
            self.close_connection = True
            data = data[: len(data) // 2]
        self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = _forward

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def flaky() -> Iterator[Callable[[str], _FlakyProxy]]:
    """Starts a _FlakyProxy in front of an endpoint URL."""
    proxies: list[_FlakyProxy] = []

    def start(upstream: str) -> _FlakyProxy:
        proxies.append(_FlakyProxy(upstream))
        threading.Thread(target=proxies[-1].serve_forever, args=(0.05,), daemon=True).start()
        return proxies[-1]

    yield start
    for proxy in proxies:
        proxy.shutdown()
        proxy.server_close()


def _http_url(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address
    return f"http://{host}:{port}"


def _fails_without_retries(proxy: _FlakyProxy, url: str, faults: list[int | str], monkeypatch: pytest.MonkeyPatch,
                           *, at: str = "", **arm: Any) -> None:
    """With MPP_READ_RETRIES=0 the same faults end the read, with an error naming the URL (and `at`, a regex)."""
    monkeypatch.setenv("MPP_READ_RETRIES", "0")
    proxy.arm(faults, **arm)
    with pytest.raises(ShardOpenError, match=re.escape(url) + at + ".*after 1 attempt "), open_url(url) as stream:
        stream.read()


def _starts(proxy: _FlakyProxy) -> list[int]:
    """The first byte of each range GET the proxy saw."""
    return [int(r[len("bytes="):].split("-")[0]) for _, r, _ in proxy.seen]


@pytest.mark.parametrize("status", [503, 500, 429])
def test_http_retries_a_failing_server_with_doubling_pauses(http_server: ThreadingHTTPServer, flaky: Callable,
                                                            shard_dir: Path, status: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPP_READ_RETRIES", "3")
    monkeypatch.setenv("MPP_READ_BACKOFF", "0.05")
    proxy = flaky(_http_url(http_server))
    proxy.arm([status, status])
    with open_url(f"{proxy.url}/{NAMES[0]}") as stream:
        assert stream.read() == (shard_dir / NAMES[0]).read_bytes()
    times = [t for t, _, _ in proxy.seen]
    assert [fault for _, _, fault in proxy.seen] == [status, status, None]
    assert times[1] - times[0] >= 0.05 and times[2] - times[1] >= 0.1
    _fails_without_retries(proxy, f"{proxy.url}/{NAMES[0]}", [status], monkeypatch)


@pytest.mark.parametrize("fault", ["drop", "cut"])
def test_http_reconnects_after_dropped_connections(http_server: ThreadingHTTPServer, flaky: Callable,
                                                   shard_dir: Path, fault: str, quick_retries: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = flaky(_http_url(http_server))
    proxy.arm([fault, fault])
    with open_url(f"{proxy.url}/{NAMES[1]}") as stream:
        assert stream.read() == (shard_dir / NAMES[1]).read_bytes()
    ranges = [r for _, r, _ in proxy.seen]
    if fault == "drop":
        assert ranges == [None, None, None]
    else:  # each cut response is resumed from the byte it broke off at
        size = len((shard_dir / NAMES[1]).read_bytes())
        assert ranges == [None, f"bytes={size // 2}-", f"bytes={size // 2 + (size - size // 2) // 2}-"]
    _fails_without_retries(proxy, f"{proxy.url}/{NAMES[1]}", [fault], monkeypatch)


def test_retry_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MPP_READ_RETRIES", "MPP_READ_BACKOFF"):
        monkeypatch.delenv(name, raising=False)
    assert remote.retry_settings() == (5, 1.0)
    monkeypatch.setenv("MPP_READ_BACKOFF", "0.5")
    monkeypatch.setenv("MPP_READ_RETRIES", "2")
    assert remote.retry_settings() == (2, 0.5)
    monkeypatch.setenv("MPP_READ_RETRIES", "-1")
    with pytest.raises(ValueError, match="MPP_READ_RETRIES='-1': expected a whole number"):
        remote.retry_settings()


@pytest.mark.parametrize("fault", [503, "drop"])
def test_http_gives_up_naming_the_url_and_the_attempts(http_server: ThreadingHTTPServer, flaky: Callable,
                                                      fault: int | str, quick_retries: None) -> None:
    proxy = flaky(_http_url(http_server))
    url = f"{proxy.url}/{NAMES[0]}"
    proxy.arm([fault] * 10)
    with pytest.raises(ShardOpenError, match=re.escape(url) + ".*after 3 attempts"):
        open_url(url)
    assert len(proxy.seen) == 3


def test_a_read_that_runs_out_of_retries_mid_shard_stops_the_loader(http_server: ThreadingHTTPServer,
                                                                     flaky: Callable, quick_retries: None) -> None:
    proxy = flaky(_http_url(http_server))
    url = f"{proxy.url}/{NAMES[0]}"
    proxy.arm(["cut"] + ["drop"] * 10)  # half the shard arrives, then the store goes away: not a broken tar
    module = ShardDataModule(train=url, batch_size=2, num_workers=0, image_size=6, shuffle_buffer=0)
    module.setup("fit")
    with pytest.raises(ShardOpenError, match=re.escape(url) + " at byte [1-9].*after 3 attempts"):
        list(module.train_dataloader())


def test_errors_mask_a_presigned_signature(http_server: ThreadingHTTPServer, flaky: Callable,
                                          quick_retries: None) -> None:
    query = "?X-Amz-Credential=AKIAEXAMPLE%2F20260101&X-Amz-Signature=0123456789abcdef"
    masked = "?X-Amz-Credential=***&X-Amz-Signature=***"
    proxy = flaky(_http_url(http_server))
    proxy.arm([503] * 3)
    for url in (f"{_http_url(http_server)}/missing.tar{query}", f"{proxy.url}/{NAMES[0]}{query}"):
        with pytest.raises(ShardOpenError) as caught:
            open_url(url).read()
        assert url.replace(query, masked) in str(caught.value)
        assert "AKIAEXAMPLE" not in str(caught.value) and "0123456789abcdef" not in str(caught.value)


@pytest.fixture
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bucket reads of 4 KiB, so that one shard takes several range GETs."""
    monkeypatch.setattr(remote, "BLOCK_SIZE", 4096)
    monkeypatch.setattr(remote, "BUFFER_SIZE", 4096)


@pytest.mark.parametrize("scheme", ["http", "s3", "gs"])
def test_every_scheme_tries_a_failing_endpoint_retries_plus_one_times(scheme: str, http_server: ThreadingHTTPServer,
                                                                      s3_env: None, s3_endpoint: str,
                                                                      gcs_endpoint: str, flaky: Callable,
                                                                      quick_retries: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # mpp's retries are the only ones: with botocore's, s3fs's and gcsfs's own, a wrong gs:// endpoint took
    # about 4 minutes to fail (6 x 6 attempts) and s3:// 75 s, where http:// took the 31 s of mpp's pauses.
    upstream = {"http": _http_url(http_server), "s3": s3_endpoint, "gs": gcs_endpoint}[scheme]
    proxy = flaky(upstream)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    url = {"http": f"{proxy.url}/{NAMES[0]}", "s3": f"s3://{BUCKET}/data/{NAMES[0]}",
           "gs": f"gs://{BUCKET}/data/{NAMES[0]}"}[scheme]
    proxy.arm([503] * 50)
    with pytest.raises(ShardOpenError, match=re.escape(url) + r".*after 3 attempts in \d+ s \(MPP_READ_RETRIES=2"):
        open_url(url).read()
    # gcsfs asks for the object and for a folder of its name at once: one or two requests per attempt.
    assert len(proxy.seen) == 3 if scheme != "gs" else 3 <= len(proxy.seen) <= 6


@pytest.mark.parametrize("fault", [503, "drop", "cut"])
def test_s3_read_resumes_where_a_range_get_failed(s3_env: None, s3_endpoint: str,
                                                  flaky: Callable, shard_dir: Path, small_reads: None,
                                                  quick_retries: None, fault: int | str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = flaky(s3_endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    url = f"s3://{BUCKET}/data/{NAMES[2]}"
    proxy.arm([fault, fault], after=1, ranged=True)
    with open_url(url) as stream:
        assert stream.read() == (shard_dir / NAMES[2]).read_bytes()
    assert [fault for _, _, fault in proxy.seen][:4] == [None, fault, fault, None]
    assert _starts(proxy)[0] == 0 and min(_starts(proxy)[1:]) > 0  # resumed, not read again from the start
    # Two faults: aiohttp itself tries once more where a kept-alive connection drops.
    _fails_without_retries(proxy, url, [fault, fault], monkeypatch, at=" at byte [1-9][0-9]* of ", after=1, ranged=True)


def test_gcs_read_resumes_where_a_range_get_failed(gcs_env: None, gcs_endpoint: str, flaky: Callable,
                                                   shard_dir: Path, small_reads: None, quick_retries: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = flaky(gcs_endpoint)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    url = f"gs://{BUCKET}/data/{NAMES[2]}"
    proxy.arm([503, 503], after=1, ranged=True)
    with open_url(url) as stream:
        assert stream.read() == (shard_dir / NAMES[2]).read_bytes()
    assert [fault for _, _, fault in proxy.seen].count(503) == 2
    assert _starts(proxy)[0] == 0 and min(_starts(proxy)[1:]) > 0
    _fails_without_retries(proxy, url, [503], monkeypatch, at=" at byte [1-9][0-9]* of ", after=1, ranged=True)
