"""Fixtures of the storage tests: a real S3-compatible server (moto's) on 127.0.0.1.

The server runs in its own process on 127.0.0.1 (``s3_server.py``), one per test module;
the clients under test (boto3 inside ``modelexpress.storage``) reach it through the
usual AWS variables, set per test with ``monkeypatch``.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from s3_server import S3Server, s3_env


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 for the module."""
    pytest.importorskip("moto", reason="moto's server is not installed")
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    yield server
    server.stop()


@pytest.fixture
def aws(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The AWS variables of ``s3`` in this process's environment; faults cleared,
    counters zeroed."""
    for key, value in s3_env(s3.endpoint).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    s3.faults()
    s3.reset()
    return s3
