"""Keep credentials out of saved configs, error messages, logs and W&B.

Three kinds of secret are masked with `***` wherever they appear in text:
- the password of a URL's userinfo: `https://user:pw@host/` -> `https://user:***@host/`;
- the value of a signing or credential query parameter: presigned S3 (`X-Amz-Signature`,
  `X-Amz-Credential`, `X-Amz-Security-Token`) and GCS (`X-Goog-Signature`, `X-Goog-Credential`)
  URLs, Azure SAS `sig`, and the usual `token`, `key`, `password`, `secret` names;
- the value of a secret environment variable set in this process (`WANDB_API_KEY`, the AWS
  keys, `HF_TOKEN`, and any variable named `*_TOKEN`, `*_SECRET`, `*_PASSWORD`, `*_API_KEY`),
  where it is at least `MIN_SECRET_LENGTH` characters long.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from typing import Any

MASK = "***"
MIN_SECRET_LENGTH = 8  # shorter values ("1", "true", "us-east-1") would mask ordinary text

SECRET_ENV_VARS = (
    "WANDB_API_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "GITHUB_TOKEN",
    "GH_TOKEN",
    "GOOGLE_API_KEY",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_CLIENT_SECRET",
)
_SECRET_ENV_NAME = re.compile(r".*_(TOKEN|SECRET|PASSWORD|API_KEY)$")

_SECRET_PARAMS = (
    "x-amz-signature",
    "x-amz-credential",
    "x-amz-security-token",
    "x-goog-signature",
    "x-goog-credential",
    "sig",
    "signature",
    "token",
    "access_token",
    "refresh_token",
    "id_token",
    "api_key",
    "apikey",
    "key",
    "password",
    "secret",
    "client_secret",
)
# A value runs to the next parameter, fragment, white space, quote or bracket, or a colon that
# ends the URL in a message ("cannot open https://...?sig=...: HTTP 403").
_QUERY_SECRET = re.compile(
    r"(?P<name>[?&;](?:" + "|".join(map(re.escape, _SECRET_PARAMS)) + r")=)(?:[^&#;:,\s'\"<>)\]}]|:(?!\s|$))+",
    re.IGNORECASE,
)
_USERINFO_PASSWORD = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^:/?#@\s]*:)[^@/?#\s]+(?=@)", re.IGNORECASE)


def secret_env_values() -> list[str]:
    """Values of this process's secret environment variables, longest first (so that a secret
    containing another is masked whole)."""
    values = {
        value
        for name, value in os.environ.items()
        if (name in SECRET_ENV_VARS or _SECRET_ENV_NAME.match(name)) and len(value) >= MIN_SECRET_LENGTH
    }
    return sorted(values, key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with URL passwords, signing query parameters and secret environment values masked."""
    text = _USERINFO_PASSWORD.sub(lambda m: m["head"] + MASK, text)
    text = _QUERY_SECRET.sub(lambda m: m["name"] + MASK, text)
    for value in secret_env_values():
        text = text.replace(value, MASK)
    return text


def redact_tree(obj: Any) -> Any:
    """A copy of nested dicts, lists, tuples and (jsonargparse) Namespaces with every string redacted;
    other leaves (numbers, paths, None) are returned as they are."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {redact_tree(k): redact_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_tree(v) for v in obj]
    if isinstance(obj, tuple):
        items = [redact_tree(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, argparse.Namespace):  # jsonargparse.Namespace is one too
        return type(obj)(**{k: redact_tree(v) for k, v in vars(obj).items()})
    return obj


class RedactingFilter(logging.Filter):
    """Masks secrets in a log record's message, arguments and traceback.

    Add it to the handlers (`handler.addFilter(RedactingFilter())`): a filter on a logger does
    not see records that propagate up from its child loggers.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact(record.getMessage())
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True
