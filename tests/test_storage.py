"""Shard URLs: expansion, the pipe: policy, and streaming from real HTTP, S3 and GCS servers on 127.0.0.1."""

from __future__ import annotations

import io
import os
import re
import socket
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from shardkit import read_all, write_shards

from mpp.data import ShardDataModule
from mpp.storage import ShardOpenError, check_pipe_allowed, expand_urls, open_url
from mpp.tarstream import iter_files

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
    """Serves files with Range support; the first GET of a path in `server.flaky` breaks off halfway."""

    def do_GET(self) -> None:
        path = self.server.root / self.path.lstrip("/")
        if not path.is_file():
            self.send_error(404)
            return
        start = int(self.headers["Range"][len("bytes="):].rstrip("-")) if "Range" in self.headers else 0
        self.server.ranges.append(start)
        body = path.read_bytes()[start:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path in self.server.flaky:
            self.server.flaky.discard(self.path)
            body = body[: len(body) // 2]
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def http_server(shard_dir: Path) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ShardHandler)
    server.root, server.flaky, server.ranges = shard_dir, set(), []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def quick_http_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPP_HTTP_RETRIES", "2")
    monkeypatch.setenv("MPP_HTTP_BACKOFF", "0.01")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_http_streams_the_same_samples_as_disk(http_server: ThreadingHTTPServer, shard_dir: Path,
                                               num_workers: int) -> None:
    host, port = http_server.server_address
    _same_as_disk(f"http://{host}:{port}/{PATTERN}", shard_dir, num_workers)


def test_http_resumes_a_broken_download(http_server: ThreadingHTTPServer, shard_dir: Path,
                                        quick_http_retries: None) -> None:
    host, port = http_server.server_address
    http_server.flaky.add(f"/{NAMES[1]}")
    http_server.ranges.clear()
    with open_url(f"http://{host}:{port}/{NAMES[1]}") as stream:
        assert stream.read() == (shard_dir / NAMES[1]).read_bytes()
    assert len(http_server.ranges) == 2 and http_server.ranges[1] > 0


def test_http_errors_name_the_url(http_server: ThreadingHTTPServer, quick_http_retries: None) -> None:
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
