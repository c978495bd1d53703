"""Reading one shard: a local file, file://, http(s)://, s3://, gs://, or (opted in) pipe:.

- s3:// goes through s3fs: the usual AWS chain (AWS_ACCESS_KEY_ID / AWS_PROFILE / instance
  role), AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) for non-AWS endpoints, read by botocore.
- gs:// goes through gcsfs: Google application-default credentials, anonymous as a last
  resort, and STORAGE_EMULATOR_HOST for an emulator.
- http(s):// is read with urllib.
- pipe: runs a shell command (webdataset's pipe reader), refused unless allow_pipe=True.

Remote reads outlast an endpoint that drops connections or answers 5xx for a while: a failed
open or read is tried again after a pause that doubles each time (MPP_READ_RETRIES, default 5;
MPP_READ_BACKOFF, default 1 s), reopening at the byte reached, and then fails with a
ShardOpenError that names the URL. This is the only retry layer: botocore's, s3fs's and gcsfs's
own retries are off, and every attempt of every scheme waits at most ATTEMPT_TIMEOUT for a
connection or a read. So every scheme meets a wrong endpoint the same way: an endpoint that
refuses fails after the pauses alone (31 s by default), one that never answers after at most
(retries + 1) x ATTEMPT_TIMEOUT more. With the libraries' retries on, a wrong
gs:// endpoint took about 5 minutes (gcsfs tries each request 6 times), s3:// 75 s and http 31 s.
Error messages pass through `mpp.secrets.redact`, so a presigned URL's signature never shows.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, BinaryIO

# gcsfs reads this when imported: its default gRPC bucket-type lookup waits about a minute
# per bucket against endpoints that do not speak gRPC (emulators, proxies).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import webdataset

from mpp.secrets import redact

BLOCK_SIZE = 8 << 20  # bytes per bucket request: tar shards are read front to back
BUFFER_SIZE = 1 << 20  # bytes per read from a remote stream
ATTEMPT_TIMEOUT = 60.0  # seconds one attempt waits for a connection or a read, whatever the scheme
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
# Errors that no retry mends: a missing object, no access, a malformed URL or name.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, ValueError)
_HINTS = {
    "s3": "; check the bucket and key, the AWS credentials and, for a non-AWS endpoint, AWS_ENDPOINT_URL",
    "gs": "; check the bucket and object, the Google credentials and, for an emulator, STORAGE_EMULATOR_HOST",
}


def check_pipe_allowed(url: str, *, allow_pipe: bool) -> None:
    """Refuse a `pipe:` URL unless the config opted in: it runs an arbitrary shell command."""
    if url.startswith("pipe:") and not allow_pipe:
        raise ValueError(
            f"refusing shard {url!r}: pipe: URLs run shell commands; "
            "set allow_pipe=True in the data config if you trust this command"
        )


class ShardOpenError(OSError):
    """A shard URL could not be opened or read to its end; credentials in the message are masked."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


def open_url(url: str, *, allow_pipe: bool = False) -> BinaryIO:
    """Open one shard for reading: local path, file://, http(s)://, s3://, gs:// or (opted in) pipe:."""
    check_pipe_allowed(url, allow_pipe=allow_pipe)
    scheme = url.split("://", 1)[0] if "://" in url else ""
    try:
        if url.startswith("pipe:"):
            return webdataset.gopen(url, "rb")
        if scheme in ("http", "https"):
            return open_http(url)
        if scheme in ("s3", "gs"):
            return open_bucket(url)
        return open(url.removeprefix("file://"), "rb")
    except ShardOpenError:
        raise
    except Exception as exc:
        raise ShardOpenError(f"cannot open shard {url}: {type(exc).__name__}: {exc}") from exc


def open_bucket(url: str) -> BinaryIO:
    """An s3:// or gs:// object through fsspec, read front to back; reads are retried and resumed."""
    scheme = url.split("://", 1)[0]

    def open_at(offset: int) -> tuple[BinaryIO, int]:
        file = _filesystem(scheme).open(url, "rb", block_size=BLOCK_SIZE, cache_type="readahead")
        file.seek(offset)
        return file, file.size

    stream = _ResumingStream(url, open_at, permanent=_permanent_errors(scheme), hint=_HINTS[scheme])
    return io.BufferedReader(stream, buffer_size=BUFFER_SIZE)


def _permanent_errors(scheme: str) -> tuple[type[BaseException], ...]:
    """What a bucket read raises that no retry mends."""
    if scheme == "s3":
        from botocore.exceptions import NoCredentialsError

        return (*_PERMANENT, NoCredentialsError)
    return _PERMANENT


_filesystems: dict[tuple[str, ...], Any] = {}


def _filesystem(scheme: str) -> Any:
    """One fsspec filesystem per process and endpoint: async clients do not survive a fork."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL", ""))
    if scheme == "gs":
        endpoint = os.environ.get("STORAGE_EMULATOR_HOST", "")
    key = (scheme, str(os.getpid()), endpoint)
    if key not in _filesystems:
        _filesystems[key] = _one_try_s3() if scheme == "s3" else _one_try_gcs()
    return _filesystems[key]


def _one_try_s3() -> Any:
    """s3fs with botocore's retries and its own off, and ATTEMPT_TIMEOUT on connecting and reading."""
    import s3fs

    timeouts = {"connect_timeout": ATTEMPT_TIMEOUT, "read_timeout": ATTEMPT_TIMEOUT}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={"retries": {"total_max_attempts": 1}, **timeouts})
    fs.retries = 1  # s3fs's own loop: one try
    return fs


def _one_try_gcs() -> Any:
    """gcsfs whose requests are tried once (mpp.internals.gcs_request_once), each within ATTEMPT_TIMEOUT."""
    import aiohttp
    import gcsfs

    from mpp.internals import gcs_request_once

    class OneTryGCSFileSystem(gcsfs.GCSFileSystem):
        _request = gcs_request_once()

    timeout = aiohttp.ClientTimeout(total=None, connect=ATTEMPT_TIMEOUT, sock_read=ATTEMPT_TIMEOUT)
    return OneTryGCSFileSystem(skip_instance_cache=True, requests_timeout=timeout)


def open_http(url: str) -> BinaryIO:
    """An http(s):// shard: GET, retried and resumed with Range requests."""

    def open_at(offset: int) -> tuple[BinaryIO, int | None]:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            request = urllib.request.Request(url, headers=headers)
            response = urllib.request.urlopen(request, timeout=ATTEMPT_TIMEOUT)
        except urllib.error.HTTPError as exc:
            if exc.code in _RETRY_STATUS:
                raise
            raise ShardOpenError(f"cannot open {url}: HTTP {exc.code} {exc.reason}") from exc
        length = response.headers.get("Content-Length")
        if offset and response.status != 206:  # the server ignored Range: skip what was read
            _discard(response, offset)
            offset = 0
        return response, offset + int(length) if length is not None else None

    return io.BufferedReader(_ResumingStream(url, open_at), buffer_size=BUFFER_SIZE)


def _discard(response: http.client.HTTPResponse, count: int) -> None:
    left = count
    while left > 0:
        chunk = response.read(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError(f"the response ended before the {count} bytes already read")
        left -= len(chunk)


def retry_settings() -> tuple[int, float]:
    """(retries, first pause in seconds) for remote reads: MPP_READ_RETRIES and MPP_READ_BACKOFF."""
    return _setting("RETRIES", int, 5), _setting("BACKOFF", float, 1.0)


def _setting(name: str, kind: type, default: float) -> Any:
    key = f"MPP_READ_{name}"
    if key not in os.environ:
        return default
    try:
        value = kind(os.environ[key])
    except ValueError:
        value = -1
    if value < 0:
        what = "a whole number" if kind is int else "a number of seconds"
        raise ValueError(f"{key}={os.environ[key]!r}: expected {what}, 0 or more")
    return value


class _ResumingStream(io.RawIOBase):
    """One remote object read front to back. A failed open or read is tried again after a pause
    that doubles each time, reopening at the current byte; a fault that outlasts the retries, or
    one of the `permanent` errors, raises ShardOpenError naming the URL."""

    def __init__(
        self,
        url: str,
        open_at: Callable[[int], tuple[BinaryIO, int | None]],
        *,
        permanent: tuple[type[BaseException], ...] = _PERMANENT,
        hint: str = "",
    ) -> None:
        super().__init__()
        self.url, self._open_at, self._permanent, self._hint = url, open_at, permanent, hint
        self._retries, self._backoff = retry_settings()
        self._pos = 0
        self._size: int | None = None
        self._stream: BinaryIO | None = None
        self._retrying(self._reopen, "open")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._retrying(lambda: self._read_once(buffer), "read")

    def _reopen(self) -> None:
        self._close_stream()
        self._stream, self._size = self._open_at(self._pos)

    def _read_once(self, buffer: Any) -> int:
        if self._stream is None:
            self._reopen()
        assert self._stream is not None
        n = self._stream.readinto(buffer) or 0  # type: ignore[attr-defined]  # every opener's stream has it
        if n == 0 and len(buffer) and self._size is not None and self._pos < self._size:
            raise ConnectionError("the connection closed early")
        self._pos += n
        return n

    def _retrying(self, step: Callable[[], Any], what: str) -> Any:
        """`step()`, tried up to 1 + retries times with doubling pauses; the stream is reopened after a failure."""
        error: BaseException | None = None
        start = time.monotonic()
        for attempt in range(self._retries + 1):
            if attempt:
                time.sleep(self._backoff * 2 ** (attempt - 1))
            try:
                return step()
            except ShardOpenError:
                raise
            except self._permanent as exc:
                raise ShardOpenError(f"cannot {what} {self.url}: {type(exc).__name__}: {exc}{self._hint}") from exc
            except Exception as exc:  # noqa: BLE001 - reset, refused, timed out, 5xx, cut short: worth another try
                error = exc
                self._close_stream()
        where = f" at byte {self._pos} of {self._size if self._size is not None else '?'}" if self._pos else ""
        attempts = f"{self._retries + 1} attempt" + ("s" if self._retries else "")
        raise ShardOpenError(
            f"cannot {what} {self.url}{where}: {type(error).__name__}: {error}; gave up after {attempts} in "
            f"{time.monotonic() - start:.0f} s (MPP_READ_RETRIES={self._retries}, MPP_READ_BACKOFF={self._backoff} s, "
            f"doubling){self._hint}"
        ) from error

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail to close; it is dropped either way
                stream.close()

    def close(self) -> None:
        self._close_stream()
        super().close()
