"""Credentials in URIs are masked wherever a URI is shown or stored (issue 37): the password of
``user:password@``, and every credential-like query parameter."""

import socket
from pathlib import Path

import pytest

from pipeline.redact import has_password, redact, unredact
from tests.helpers import moe


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("http://host:5095/?token=abc123", "http://host:5095/?token=***"),
        ("http://u:pw@h:1/x?a=1&access_token=zz&b=2", "http://u:***@h:1/x?a=1&access_token=***&b=2"),
        ("https://s3.example/o?X-Amz-Signature=ff&X-Amz-Credential=cc&x=1", "https://s3.example/o?X-Amz-Signature=***&X-Amz-Credential=***&x=1"),
        ("https://blob.example/c?sv=2020&sig=abc%2Fdef", "https://blob.example/c?sv=***&sig=***"),
        ("http://h/?api_key=k1;password=p2", "http://h/?api_key=***;password=***"),
        ("http://h/?keyboard=1&monkey=2", "http://h/?keyboard=1&monkey=2"),
        ("postgresql+psycopg2://mlflow@127.0.0.1:5432/mlflow", "postgresql+psycopg2://mlflow@127.0.0.1:5432/mlflow"),
    ],
)
def test_every_credential_form_is_masked(uri, shown):
    assert redact(uri) == shown
    assert has_password(uri) == (shown != uri)
    assert not has_password(shown)
    assert unredact(shown, uri) == uri  # a job gets the real URI back from its environment


def test_a_query_token_never_reaches_the_output_or_any_file(workspace):
    with socket.socket() as s:  # a port nothing listens on: the tracker is unreachable
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = "tok3n-SECRET-value"
    r = moe("tokenize", env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}/?token={secret}", "MOE_TRACKING_DEADLINE_S": "5"})
    assert r.returncode == 0, r.stderr
    assert secret not in r.stdout + r.stderr
    assert "token=***" in r.stdout + r.stderr  # the warning names the server, masked
    for path in Path(workspace).rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_log_records_and_their_tracebacks_are_masked():
    import logging

    from pipeline.redact import install_log_redaction

    install_log_redaction()
    stream = __import__("io").StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("moe-test-redaction")
    log.addHandler(handler)
    try:
        log.warning("retrying %s", "http://h/?token=abc123")
        try:
            raise ConnectionError("GET http://u:pw123@h/x?sig=zzz failed")
        except ConnectionError:
            log.exception("request failed")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "abc123" not in text and "pw123" not in text and "zzz" not in text
    assert "token=***" in text and "sig=***" in text
