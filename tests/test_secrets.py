"""Credentials are masked in text, config trees and log records; ordinary URLs, paths and patterns are not."""

from __future__ import annotations

import argparse
import logging

import pytest
from jsonargparse import Namespace

from mpp.secrets import MASK, RedactingFilter, redact, redact_tree

WANDB_KEY = "some-fake-key-123456789"


@pytest.fixture(autouse=True)
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A known set of secret variables, and none of this machine's."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN", "GITHUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-0123456789")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # under 8 characters: would mask ordinary words
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/home/me/.config/gcloud/key.json")


@pytest.mark.parametrize("text, expected", [
    ("https://user:pw@host/a.tar", "https://user:***@host/a.tar"),
    ("fetch s3+https://me:p%40ss@minio.local:9000/b/x.tar now", "fetch s3+https://me:***@minio.local:9000/b/x.tar now"),
    ("postgres://u:hunter2@db:5432/runs", "postgres://u:***@db:5432/runs"),
])
def test_url_passwords_are_masked(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_signing_query_parameters_are_masked_case_insensitively() -> None:
    s3 = ("https://b.s3.amazonaws.com/train-000001.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
          "&X-Amz-Credential=AKIAEXAMPLE%2F20260101%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20260101T000000Z"
          "&X-Amz-Expires=3600&X-Amz-Security-Token=FwoGZXIvYXdzEXAMPLE&X-Amz-SignedHeaders=host"
          "&X-Amz-Signature=0123456789abcdef")
    assert redact(f"cannot open {s3}: HTTP 403") == (
        "cannot open https://b.s3.amazonaws.com/train-000001.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=***&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-Security-Token=***"
        "&X-Amz-SignedHeaders=host&X-Amz-Signature=***: HTTP 403")
    gcs = "https://storage.googleapis.com/b/x.tar?x-goog-credential=sa%40p.iam&X-Goog-Signature=abc123#part"
    assert redact(gcs) == "https://storage.googleapis.com/b/x.tar?x-goog-credential=***&X-Goog-Signature=***#part"
    azure = "'https://acct.blob.core.windows.net/c/x.tar?sv=2022-11-02&se=2026&sp=r&sig=Zm9v%2Bbar%3D'"
    assert redact(azure) == "'https://acct.blob.core.windows.net/c/x.tar?sv=2022-11-02&se=2026&sp=r&sig=***'"
    for name in ("token", "access_token", "api_key", "APIKEY", "key", "Password", "secret"):
        assert redact(f"https://h/x?a=1&{name}=s3cr3t&b=2") == f"https://h/x?a=1&{name}=***&b=2"
    assert redact("(see https://h/x?token=a:b:c)") == "(see https://h/x?token=***)"
    assert redact('{"train": "https://h/x?key=abc", "val": null}') == '{"train": "https://h/x?key=***", "val": null}'


def test_secret_environment_values_are_masked_anywhere() -> None:
    text = (f"wandb login {WANDB_KEY}; aws secret wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY; "
            "header Bearer tok-0123456789")
    assert redact(text) == "wandb login ***; aws secret ***; header Bearer ***"


def test_ordinary_text_urls_paths_and_patterns_are_unchanged() -> None:
    for text in [
        "https://example.org/shards/train-{000000..000031}.tar",
        "s3://mpp-shards/data/train-{000000..000002}.tar",
        "gs://bucket/a/b-*.tar",
        "http://127.0.0.1:8080/x.tar?part=1&monkey=2&keys=3",
        "/home/me/.config/gcloud/key.json",  # GOOGLE_APPLICATION_CREDENTIALS is a path, not a secret
        "pipe:curl -s https://host/x.tar",
        "/data/run:1@2/ckpt",
        "testing the testing endpoint",  # AWS_ACCESS_KEY_ID=testing is too short to mask
        "epoch 3: loss 0.25 at 12:30",
    ]:
        assert redact(text) == text


def test_redact_tree_copies_nested_containers_and_namespaces() -> None:
    url = "https://u:pw@h/x.tar?sig=abc"
    tree = {
        "data": {"train": [url, "/local/x.tar"], "sizes": (3, url)},
        "logger": Namespace(init_args=Namespace(api_key=WANDB_KEY, project="mpp")),
        "plain": argparse.Namespace(token=WANDB_KEY, steps=10),
        url: None,
    }
    clean = redact_tree(tree)
    masked = "https://u:***@h/x.tar?sig=***"
    assert clean["data"] == {"train": [masked, "/local/x.tar"], "sizes": (3, masked)}
    assert isinstance(clean["logger"], Namespace) and clean["logger"].init_args.api_key == MASK
    assert clean["logger"].init_args.project == "mpp"
    assert isinstance(clean["plain"], argparse.Namespace) and vars(clean["plain"]) == {"token": MASK, "steps": 10}
    assert masked in clean
    assert tree["data"]["train"][0] == url and tree["logger"].init_args.api_key == WANDB_KEY  # the input is untouched


def test_redacting_filter_masks_message_arguments_and_traceback(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("mpp.test_secrets")
    caplog.handler.addFilter(RedactingFilter())
    caplog.set_level(logging.INFO, logger=logger.name)
    logger.info("opening %s with key %s", "https://u:pw@h/x.tar", WANDB_KEY)
    try:
        raise OSError(f"cannot open https://h/x.tar?X-Amz-Signature=deadbeef key {WANDB_KEY}")
    except OSError:
        logger.exception("read failed")
    text = caplog.text
    assert "opening https://u:***@h/x.tar with key ***" in text
    assert "X-Amz-Signature=***" in text and "read failed" in text and "OSError" in text
    assert "deadbeef" not in text and WANDB_KEY not in text and ":pw@" not in text
    assert caplog.records[0].args is None
