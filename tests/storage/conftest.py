"""Fixtures of the storage tests: a real S3-compatible server (moto's) and small checkpoints.

The server runs in its own process on 127.0.0.1 (``s3_server.py``), one per test module;
the clients under test (boto3 inside ``modelexpress.storage``) reach it through the
usual AWS variables, set per test with ``monkeypatch``.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from s3_server import S3Server, s3_env  # noqa: E402

BUCKET = "mx-tests"


def small_checkpoint(directory: pathlib.Path, *, shard_bytes: int = 96 << 10,
                     seed: int = 5) -> pathlib.Path:
    """A sharded safetensors checkpoint of ~300 KB: tensors of several dtypes and sizes
    (a large one cut into several ranges, small ones that share a range)."""
    import torch

    from modelexpress.checkpoint import save_checkpoint

    gen = torch.Generator().manual_seed(seed)
    tensors = {"embed.weight": torch.rand(200, 128, generator=gen).to(torch.bfloat16)}
    for i in range(6):
        tensors[f"layers.{i}.norm.weight"] = torch.rand(128, generator=gen)
        tensors[f"layers.{i}.proj.weight"] = torch.rand(64, 128, generator=gen).to(torch.float16)
        tensors[f"layers.{i}.step"] = torch.tensor([i], dtype=torch.int64)
    tensors["lm_head.weight"] = torch.rand(200, 128, generator=gen).to(torch.bfloat16)
    save_checkpoint(tensors, directory, shard_bytes=shard_bytes)
    return directory


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
