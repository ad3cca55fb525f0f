"""A checkpoint in S3 or an S3-compatible store, read with ranged GETs: :class:`S3Storage`.

Why boto3's ranged GETs, each body read with ``readinto`` straight into the destination
(one request per range, the reader's thread pool running them), and not
runai-model-streamer, the library vLLM's ``--load-format runai_streamer`` uses, nor
boto3's own transfer manager: measured by ``bench/storage.py`` against the same S3
server, all three reading the same ranges into the caller's memory (docs/benchmarks.md,
"Reading storage", has the command, the machine and the logs,
``bench/results/2026-12-06-cpu2/storage_library_run*.log``). 256 MiB from moto's server
on 127.0.0.1, 8 ranges of 8 MiB at once, 2-core VM: the client's CPU per GB read was
0.82-0.89 s for boto3's ranged GETs, 1.24 s for the transfer manager, 1.63-2.59 s for
runai-model-streamer; the first range landed after 71-90 ms, 108 ms and 210-217 ms (runai
1.1-1.3 s on its first read: starting the AWS C++ SDK). Wall times (0.16-0.27 GB/s) were
moto's pace more than the clients' and changed order from run to run. Besides: the
transfer manager adds a copy and a queue per write and says how many bytes landed, not
which; runai weighs 20 MB of native libraries and a torch requirement. boto3 also gives what the
origin needs for its faults: per-request timeouts (``MX_STORAGE_TIMEOUT_S``), S3's error
codes (NoSuchKey, AccessDenied, InvalidRange) to say what went wrong in one line, and
the AWS variables read the way every AWS tool reads them (``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` for an S3-compatible endpoint; ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``; ``AWS_REGION``; profiles and instance
roles too).

A body that ends early (a connection cut mid-object) is read again from where it
stopped, once; a second short body is a :class:`~modelexpress.errors.StorageReadError`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from modelexpress._optional import require
from modelexpress.errors import ConfigError, StorageReadError
from modelexpress.storage.base import StorageOptions, StoredFile

__all__ = ["S3Storage", "parse_s3_url"]

log = logging.getLogger(__name__)

_BODY_RETRIES = 1


def parse_s3_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket/prefix`` (prefix without a trailing slash).

    Raises:
        ConfigError: not ``s3://BUCKET[/PREFIX]``.
    """
    rest = url[len("s3://"):] if url.startswith("s3://") else ""
    bucket, _, prefix = rest.partition("/")
    if not bucket or any(c in bucket for c in " \\?#"):
        raise ConfigError(f"{url!r} is not an S3 URL; use s3://BUCKET/PREFIX (the directory "
                          "of the checkpoint's *.safetensors objects)")
    return bucket, prefix.strip("/")


class S3Storage:
    """The ``*.safetensors`` objects under ``s3://bucket/prefix/`` (or that one object).

    Args:
        url: ``s3://bucket/prefix``.
        options: concurrency (the connection pool), timeouts.

    Raises:
        ConfigError: a malformed URL.
        DependencyError: boto3 is not installed (``pip install 'modelexpress[s3]'``).
    """

    def __init__(self, url: str, options: StorageOptions | None = None) -> None:
        boto3 = require("boto3", "reading checkpoints from S3")
        from botocore.config import Config

        self.options = options or StorageOptions()
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._keys: dict[str, str] = {}
        # The endpoint, credentials and region come from the environment the way every
        # AWS tool reads them (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
        # ...). Retries: botocore's standard mode repeats throttles and connection errors
        # of a request; a body cut short is read again here (read()).
        self._client = boto3.session.Session().client("s3", config=Config(
            connect_timeout=self.options.timeout_s, read_timeout=self.options.timeout_s,
            retries={"max_attempts": 3, "mode": "standard"},
            max_pool_connections=max(self.options.concurrency, 10)))
        self._errors = _botocore_errors()

    def _where(self, key: str = "") -> str:
        endpoint = getattr(self._client.meta, "endpoint_url", "") or "AWS"
        return f"s3://{self.bucket}/{key}" if key else f"{self.url} (endpoint {endpoint})"

    def files(self) -> list[StoredFile]:
        single = self.prefix.endswith(".safetensors")
        found: dict[str, StoredFile] = {}
        try:
            if single:
                head = self._client.head_object(Bucket=self.bucket, Key=self.prefix)
                name = self.prefix.rsplit("/", 1)[-1]
                self._keys[name] = self.prefix
                found[name] = StoredFile(name, int(head["ContentLength"]))
            else:
                base = f"{self.prefix}/" if self.prefix else ""
                pages = self._client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base, Delimiter="/")
                for page in pages:
                    for obj in page.get("Contents", ()):
                        key = obj["Key"]
                        name = key[len(base):]
                        if name.endswith(".safetensors"):
                            self._keys[name] = key
                            found[name] = StoredFile(name, int(obj["Size"]))
        except self._errors.base as exc:
            raise self._failure(exc, self.prefix, "listing the checkpoint") from exc
        if not found:
            raise ConfigError(f"{self._where()} holds no *.safetensors object (expected the "
                              "directory of a safetensors checkpoint)")
        return [found[k] for k in sorted(found)]

    def read(self, name: str, offset: int, out: memoryview) -> None:
        key = self._keys.get(name) or (f"{self.prefix}/{name}" if self.prefix else name)
        want = len(out)
        got = 0
        retries = _BODY_RETRIES
        while got < want:
            first = offset + got
            try:
                body = self._client.get_object(
                    Bucket=self.bucket, Key=key,
                    Range=f"bytes={first}-{offset + want - 1}")["Body"]
                try:
                    while got < want:
                        n = body.readinto(out[got:])
                        if not n:
                            break
                        got += n
                finally:
                    body.close()
            except self._errors.streaming as exc:  # the body ended early: as a short one
                cause: BaseException | None = exc
            except self._errors.base as exc:
                raise self._failure(exc, key, f"reading {want} bytes at {offset}") from exc
            else:
                cause = None
            if got < want:
                if retries <= 0:
                    raise StorageReadError(
                        f"{self._where(key)}: the body of a read of {want} bytes at {offset} "
                        f"ended after {got} bytes, twice (the object is shorter than its "
                        "header says, or the connection keeps dropping)") from cause
                retries -= 1
                log.warning("%s: a read ended %d bytes short; reading the rest again",
                            self._where(key), want - got)
        with self._lock:
            self.bytes_read += got

    def _failure(self, exc: BaseException, key: str, doing: str) -> StorageReadError:
        """One line for a botocore error: what, where, what to do."""
        where = self._where(key)
        errors = self._errors
        if isinstance(exc, errors.client):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return StorageReadError(f"s3://{self.bucket}: no such bucket ({code}); check "
                                        "the URL (MX_MODEL_STORAGE, --from)")
            if code in ("NoSuchKey", "NotFound", "404") or status == 404:
                return StorageReadError(f"{where}: no such object ({code or status}) while "
                                        f"{doing}; check the URL (MX_MODEL_STORAGE, --from)")
            if code in ("AccessDenied", "Forbidden", "403", "InvalidAccessKeyId",
                        "SignatureDoesNotMatch") or status == 403:
                return StorageReadError(
                    f"{where}: access denied ({code or status}) while {doing}; check "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the role) and the bucket's "
                    "policy")
            if code == "InvalidRange" or status == 416:
                return StorageReadError(f"{where}: the object is shorter than its header says "
                                        f"({code or status} while {doing}); upload it again")
            return StorageReadError(f"{where}: {code or status} while {doing}: "
                                    f"{exc.response.get('Error', {}).get('Message', exc)}")
        if isinstance(exc, errors.timeout):
            return StorageReadError(
                f"{where}: no answer within {self.options.timeout_s:g} s (MX_STORAGE_TIMEOUT_S) "
                f"while {doing}: the endpoint is slow or unreachable")
        if isinstance(exc, errors.credentials):
            return StorageReadError(f"{where}: no AWS credentials ({exc}); set "
                                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile)")
        if isinstance(exc, errors.connect):
            return StorageReadError(f"{where}: cannot reach the endpoint ({exc}); check "
                                    "AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL")
        return StorageReadError(f"{where}: {type(exc).__name__} while {doing}: {exc}")

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "S3Storage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Errors:
    """The botocore exception classes this module maps (imported once, lazily)."""

    def __init__(self, exceptions: Any) -> None:
        self.base = (exceptions.BotoCoreError, exceptions.ClientError)
        self.client = exceptions.ClientError
        self.streaming = (exceptions.ResponseStreamingError, exceptions.IncompleteReadError)
        self.timeout = (exceptions.ReadTimeoutError, exceptions.ConnectTimeoutError)
        self.credentials = (exceptions.NoCredentialsError, exceptions.PartialCredentialsError)
        self.connect = (exceptions.EndpointConnectionError, exceptions.ConnectionClosedError)


def _botocore_errors() -> _Errors:
    return _Errors(require("botocore.exceptions", "reading checkpoints from S3"))
