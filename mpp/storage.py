"""Where shards come from: URL expansion and openers for s3://, gs://, http(s):// and pipe:.

Importing this module installs the s3, gs, http and https openers in webdataset's gopen
table (which otherwise shells out to curl / gsutil and has no s3), so any process that
imports it, DataLoader workers included, reads those URLs the same way.

- s3:// goes through s3fs: the usual AWS chain (AWS_ACCESS_KEY_ID / AWS_PROFILE / instance
  role), AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) for non-AWS endpoints, read by botocore.
- gs:// goes through gcsfs: Google application-default credentials, anonymous as a last
  resort, and STORAGE_EMULATOR_HOST for an emulator.
- http(s):// is read with urllib, retried with exponential backoff and resumed with a Range
  request where a connection breaks off (MPP_HTTP_RETRIES, MPP_HTTP_BACKOFF seconds).
- pipe: runs a shell command, so it is refused unless the caller passes allow_pipe=True.
"""

from __future__ import annotations

import glob
import http.client
import io
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, BinaryIO

# gcsfs reads this when imported: its default gRPC bucket-type lookup waits about a minute
# per bucket against endpoints that do not speak gRPC (emulators, proxies).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import braceexpand
import webdataset
from webdataset.gopen import gopen_schemes

REMOTE_SCHEMES = ("http", "https", "s3", "gs")
BLOCK_SIZE = 8 << 20  # bytes per bucket request: tar shards are read front to back
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
_HINTS = {
    "s3": "check the bucket and key, the AWS credentials and, for a non-AWS endpoint, AWS_ENDPOINT_URL",
    "gs": "check the bucket and object, the Google credentials and, for an emulator, STORAGE_EMULATOR_HOST",
}


class ShardOpenError(OSError):
    """A shard URL could not be opened or read to its end."""


def expand_urls(spec: str | Sequence[str], *, allow_pipe: bool = False) -> list[str]:
    """A shard spec (path, brace pattern, local glob, URL, or a list of those) -> the list of shard URLs.

    Local shards must exist; `pipe:` commands are refused unless `allow_pipe`.
    """
    items = [spec] if isinstance(spec, str) else list(spec)
    if not items:
        raise ValueError("the shard list is empty: give a path, a brace pattern or a URL")
    urls: list[str] = []
    for item in items:
        for url in braceexpand.braceexpand(item):
            urls.extend(_checked(url, item, allow_pipe))
    return urls


def _checked(url: str, item: str, allow_pipe: bool) -> list[str]:
    """One expanded entry -> its shard URLs, or an error saying what is wrong with it."""
    if url.startswith("pipe:"):
        check_pipe_allowed(url, allow_pipe=allow_pipe)
        return [url]
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme in REMOTE_SCHEMES:
        return [url]
    if scheme not in ("", "file"):
        raise ValueError(f"shard {url!r}: unsupported scheme {scheme!r}; use a path, http(s)://, s3://, gs:// or pipe:")
    path = url[len("file://") :] if scheme == "file" else url
    if glob.has_magic(path):
        matches = sorted(glob.glob(path))
        if not matches:
            raise FileNotFoundError(f"shard pattern {item!r} matches no file{_relative(path)}")
        return matches
    if not os.path.isfile(path):
        origin = "" if item == url else f" (from {item!r})"
        raise FileNotFoundError(f"shard {path}{origin} does not exist{_relative(path)}")
    return [path]


def _relative(path: str) -> str:
    return "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"


def check_pipe_allowed(url: str, *, allow_pipe: bool) -> None:
    """Refuse a `pipe:` URL unless the config opted in: it runs an arbitrary shell command."""
    if url.startswith("pipe:") and not allow_pipe:
        raise ValueError(
            f"refusing shard {url!r}: pipe: URLs run shell commands; "
            "set allow_pipe=True in the data config if you trust this command"
        )


def open_url(url: str, *, allow_pipe: bool = False) -> BinaryIO:
    """Open one shard for reading: local path, file://, http(s)://, s3://, gs:// or (opted in) pipe:."""
    check_pipe_allowed(url, allow_pipe=allow_pipe)
    try:
        return webdataset.gopen(url, "rb")
    except ShardOpenError:
        raise
    except Exception as exc:
        raise ShardOpenError(f"cannot open shard {url}: {type(exc).__name__}: {exc}") from exc


def open_bucket(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> BinaryIO:
    """gopen handler for s3:// and gs:// through fsspec."""
    scheme = url.split("://", 1)[0]
    try:
        fs = _filesystem(scheme)
        if mode.startswith("r"):
            return fs.open(url, "rb", block_size=BLOCK_SIZE, cache_type="readahead")
        return fs.open(url, mode)
    except Exception as exc:
        raise ShardOpenError(f"cannot open {url}: {type(exc).__name__}: {exc}; {_HINTS[scheme]}") from exc


_filesystems: dict[tuple[str, ...], Any] = {}


def _filesystem(scheme: str) -> Any:
    """One fsspec filesystem per process and endpoint: async clients do not survive a fork."""
    import fsspec

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL", ""))
    if scheme == "gs":
        endpoint = os.environ.get("STORAGE_EMULATOR_HOST", "")
    key = (scheme, str(os.getpid()), endpoint)
    if key not in _filesystems:
        _filesystems[key] = fsspec.filesystem(scheme, skip_instance_cache=True)
    return _filesystems[key]


def open_http(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> BinaryIO:
    """gopen handler for http(s)://: a buffered reader that retries and resumes."""
    if not mode.startswith("r"):
        raise ValueError(f"cannot write to {url}: http(s) shards are read-only")
    retries = int(os.environ.get("MPP_HTTP_RETRIES", "5"))
    backoff = float(os.environ.get("MPP_HTTP_BACKOFF", "1.0"))
    return io.BufferedReader(_HttpStream(url, retries=retries, backoff=backoff), buffer_size=1 << 20)


class _HttpStream(io.RawIOBase):
    """The body of one HTTP(S) GET; where the connection drops early it reconnects from the current byte."""

    def __init__(self, url: str, *, retries: int, backoff: float, timeout: float = 60.0) -> None:
        super().__init__()
        self.url, self._retries, self._backoff, self._timeout = url, retries, backoff, timeout
        self._pos = 0
        self._size: int | None = None
        self._response: http.client.HTTPResponse | None = None
        self._response = self._connect()

    def readable(self) -> bool:
        return True

    def _connect(self) -> http.client.HTTPResponse:
        """GET from the current position, retrying transient failures with exponential backoff."""
        error: BaseException | None = None
        for attempt in range(self._retries + 1):
            if attempt:
                time.sleep(self._backoff * 2 ** (attempt - 1))
            headers = {"Range": f"bytes={self._pos}-"} if self._pos else {}
            try:
                response = urllib.request.urlopen(urllib.request.Request(self.url, headers=headers), timeout=self._timeout)
            except urllib.error.HTTPError as exc:
                if exc.code not in _RETRY_STATUS:
                    raise ShardOpenError(f"cannot open {self.url}: HTTP {exc.code} {exc.reason}") from exc
                error = exc
                continue
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, DNS
                error = exc
                continue
            if self._size is None:
                length = response.headers.get("Content-Length")
                self._size = int(length) if length is not None else None
            if self._pos and response.status != 206:
                _discard(response, self._pos, self.url)  # the server ignored Range: skip what was read
            return response
        raise ShardOpenError(f"cannot open {self.url} after {self._retries + 1} attempts: {error}") from error

    def readinto(self, buffer: Any) -> int:
        for _ in range(self._retries + 1):
            try:
                n = self._response.readinto(buffer) if self._response is not None else -1
            except (OSError, http.client.HTTPException):
                n = -1
            if n > 0:
                self._pos += n
                return n
            if n == 0 and (self._size is None or self._pos >= self._size):
                return 0
            self._close_response()
            self._response = self._connect()
        raise ShardOpenError(f"reading {self.url} broke off at byte {self._pos} of {self._size}; retries exhausted")

    def _close_response(self) -> None:
        if self._response is not None:
            self._response.close()
            self._response = None

    def close(self) -> None:
        self._close_response()
        super().close()


def _discard(response: http.client.HTTPResponse, count: int, url: str) -> None:
    left = count
    while left > 0:
        chunk = response.read(min(left, 1 << 20))
        if not chunk:
            raise ShardOpenError(f"{url} came back shorter than the {count} bytes already read")
        left -= len(chunk)


def register_openers() -> None:
    """Install this module's openers for s3, gs, http and https in webdataset's gopen table."""
    for scheme in ("s3", "gs"):
        gopen_schemes[scheme] = open_bucket
    for scheme in ("http", "https"):
        gopen_schemes[scheme] = open_http


register_openers()
