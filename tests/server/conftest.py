"""Fixtures of the control-plane tests: real servers and a real Redis."""

from __future__ import annotations

import pathlib
from typing import Iterator

import pytest

from modelexpress.client import MxClient
from modelexpress.identity import ModelIdentity
from mx_server_procs import TOKEN, RedisProc, ServerProc


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="module")
def server(module_tmp: pathlib.Path) -> Iterator[ServerProc]:
    """One SQLite-backed server with a token and a small manifest limit."""
    srv = ServerProc(f"sqlite:///{module_tmp}/mx.db", module_tmp,
                     env={"MX_SERVER_MAX_MANIFEST_BYTES": "65536"}).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: ServerProc) -> Iterator[MxClient]:
    with MxClient(server.url, token=TOKEN, timeout_s=30.0, retries=2) as c:
        yield c


@pytest.fixture()
def redis_proc(tmp_path: pathlib.Path) -> Iterator[RedisProc]:
    proc = RedisProc(tmp_path)
    yield proc
    proc.stop()


def make_identity(model: str = "acme/tiny", **kw: object) -> ModelIdentity:
    """A distinct identity per test (pass a unique model name)."""
    return ModelIdentity(model=model, **kw)  # type: ignore[arg-type]


def manifest(n: int = 3) -> dict:
    """A manifest-shaped JSON object (the server treats it as opaque)."""
    return {"version": 1, "tensors": [
        {"name": f"layer.{i}.weight", "dtype": "bfloat16", "shape": [4, 4], "nbytes": 32,
         "addr": 4096 * i, "device": 0, "digest": f"{i:064x}"} for i in range(n)]}
