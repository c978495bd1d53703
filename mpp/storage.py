"""Where shards come from: URL expansion and openers for s3://, gs://, http(s):// and pipe:.

Importing this module installs the s3, gs, http and https openers in webdataset's gopen
table (which otherwise shells out to curl / gsutil and has no s3), so any process that
imports it, DataLoader workers included, reads those URLs the same way.

- s3:// goes through s3fs: the usual AWS chain (AWS_ACCESS_KEY_ID / AWS_PROFILE / instance
  role), AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) for non-AWS endpoints, read by botocore.
- gs:// goes through gcsfs: Google application-default credentials, anonymous as a last
  resort, and STORAGE_EMULATOR_HOST for an emulator.
- http(s):// is read with urllib.
- pipe: runs a shell command, so it is refused unless the caller passes allow_pipe=True.

Remote reads outlast an endpoint that drops connections or answers 5xx for a while: a failed
open or read is tried again after a pause that doubles each time (MPP_READ_RETRIES, default 5;
MPP_READ_BACKOFF, default 1 s), reopening at the byte reached, and then fails with a
ShardOpenError that names the URL. botocore and gcsfs retry such faults first on their own;
this layer catches what their budgets leave, e.g. a range GET cut short after s3fs's fifth try.
Error messages pass through `mpp.secrets.redact`, so a presigned URL's signature never shows.
"""

from __future__ import annotations

import contextlib
import glob
import http.client
import io
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

# gcsfs reads this when imported: its default gRPC bucket-type lookup waits about a minute
# per bucket against endpoints that do not speak gRPC (emulators, proxies).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import braceexpand
import webdataset
from webdataset.gopen import gopen_schemes

from mpp.secrets import redact

REMOTE_SCHEMES = ("http", "https", "s3", "gs")
BLOCK_SIZE = 8 << 20  # bytes per bucket request: tar shards are read front to back
BUFFER_SIZE = 1 << 20  # bytes per read from a remote stream
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
# Errors that no retry mends: a missing object, no access, a malformed URL or name.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, ValueError)
_HINTS = {
    "s3": "; check the bucket and key, the AWS credentials and, for a non-AWS endpoint, AWS_ENDPOINT_URL",
    "gs": "; check the bucket and object, the Google credentials and, for an emulator, STORAGE_EMULATOR_HOST",
}


class ShardOpenError(OSError):
    """A shard URL could not be opened or read to its end; credentials in the message are masked."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


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
    if os.path.isdir(path):
        raise IsADirectoryError(f"shard {path} is a folder, not a tar file: {folder_patterns(path)}")
    if not os.path.isfile(path):
        origin = "" if item == url else f" (from {item!r})"
        raise FileNotFoundError(f"shard {path}{origin} does not exist{_relative(path)}")
    return [path]


def folder_patterns(folder: str) -> str:
    """What to give instead of a folder: a brace pattern for each run of numbered tars in it."""
    runs: dict[tuple[str, str], list[str]] = {}
    for name in sorted(os.listdir(folder)):
        if match := re.fullmatch(r"(.*?)(\d+)(\.tar|\.tar\.gz|\.tgz)", name):
            runs.setdefault((match.group(1), match.group(3)), []).append(match.group(2))
    if not runs:
        return "it holds no numbered .tar shards; give a path, a brace pattern or a glob of tar files"
    base = folder.rstrip("/")
    patterns = []
    for (prefix, suffix), numbers in runs.items():
        numbered = [int(n) for n in numbers]
        contiguous = numbered == list(range(numbered[0], numbered[0] + len(numbered)))
        if len(numbers) == 1:
            patterns.append(f"'{base}/{prefix}{numbers[0]}{suffix}'")
        elif contiguous and len({len(n) for n in numbers}) == 1:
            patterns.append(f"'{base}/{prefix}{{{numbers[0]}..{numbers[-1]}}}{suffix}'")
        else:
            patterns.append(f"'{base}/{prefix}*{suffix}'")
    return "give its shards as a pattern, e.g. " + " or ".join(patterns)


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
    """gopen handler for s3:// and gs:// through fsspec; reads are retried and resumed."""
    scheme = url.split("://", 1)[0]
    if not mode.startswith("r"):
        try:
            return _filesystem(scheme).open(url, mode)
        except Exception as exc:
            raise ShardOpenError(f"cannot open {url}: {type(exc).__name__}: {exc}{_HINTS[scheme]}") from exc

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
    import fsspec

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL", ""))
    if scheme == "gs":
        endpoint = os.environ.get("STORAGE_EMULATOR_HOST", "")
    key = (scheme, str(os.getpid()), endpoint)
    if key not in _filesystems:
        _filesystems[key] = fsspec.filesystem(scheme, skip_instance_cache=True)
    return _filesystems[key]


def open_http(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> BinaryIO:
    """gopen handler for http(s)://: GET, retried and resumed with Range requests."""
    if not mode.startswith("r"):
        raise ValueError(f"cannot write to {redact(url)}: http(s) shards are read-only")

    def open_at(offset: int) -> tuple[BinaryIO, int | None]:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60.0)
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
    """(retries, first pause in seconds) for remote reads: MPP_READ_RETRIES and MPP_READ_BACKOFF.

    MPP_HTTP_RETRIES and MPP_HTTP_BACKOFF, the names from when only http(s) was retried, still work.
    """
    return _setting("RETRIES", int, 5), _setting("BACKOFF", float, 1.0)


def _setting(name: str, kind: type, default: float) -> Any:
    for key in (f"MPP_READ_{name}", f"MPP_HTTP_{name}"):
        if key in os.environ:
            try:
                value = kind(os.environ[key])
            except ValueError:
                value = -1
            if value < 0:
                what = "a whole number" if kind is int else "a number of seconds"
                raise ValueError(f"{key}={os.environ[key]!r}: expected {what}, 0 or more")
            return value
    return default


class _ResumingStream(io.RawIOBase):
    """One remote object read front to back. A failed open or read is tried again after a pause
    that doubles each time, reopening at the current byte; a fault that outlasts the retries, or
    one of the `permanent` errors, raises ShardOpenError naming the URL."""

    def __init__(self, url: str, open_at: Callable[[int], tuple[BinaryIO, int | None]], *,
                 permanent: tuple[type[BaseException], ...] = _PERMANENT, hint: str = "") -> None:
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
        n = self._stream.readinto(buffer) or 0
        if n == 0 and len(buffer) and self._size is not None and self._pos < self._size:
            raise ConnectionError("the connection closed early")
        self._pos += n
        return n

    def _retrying(self, step: Callable[[], Any], what: str) -> Any:
        """`step()`, tried up to 1 + retries times with doubling pauses; the stream is reopened after a failure."""
        error: BaseException | None = None
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
            f"cannot {what} {self.url}{where}: {type(error).__name__}: {error}; gave up after {attempts} "
            f"(MPP_READ_RETRIES={self._retries}, MPP_READ_BACKOFF={self._backoff} s, doubling){self._hint}"
        ) from error

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail to close; it is dropped either way
                stream.close()

    def close(self) -> None:
        self._close_stream()
        super().close()


def register_openers() -> None:
    """Install this module's openers for s3, gs, http and https in webdataset's gopen table."""
    for scheme in ("s3", "gs"):
        gopen_schemes[scheme] = open_bucket
    for scheme in ("http", "https"):
        gopen_schemes[scheme] = open_http


register_openers()
