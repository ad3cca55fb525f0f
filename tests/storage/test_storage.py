"""Reading checkpoints from storage: a directory and a real S3-compatible server (moto's).

The bytes must equal what ``load_checkpoint`` reads; the watermark must only ever cover
landed bytes; a reader that holds a prefix reads only the rest; every storage fault
(missing object, 403, truncated object, a body cut short, a slow endpoint) is one line
that names the URL, and nothing is reported loaded.
"""

from __future__ import annotations

import pathlib
import time

import pytest

from zero_checkpoints import BUCKET, small_checkpoint
from modelexpress.checkpoint import allocate_slab, load_checkpoint
from modelexpress.errors import CheckpointError, ConfigError, StorageReadError
from modelexpress.storage import (StorageOptions, StorageReader, open_storage, range_bytes_for,
                                  read_checkpoint, read_layout)

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return small_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")


@pytest.fixture(scope="module")
def uploaded(s3, ckpt: pathlib.Path) -> str:  # noqa: ANN001 - the S3Server fixture
    s3.upload_dir(ckpt, BUCKET, "models/small")
    return f"s3://{BUCKET}/models/small"


def _same(got: dict, want: dict) -> None:
    assert list(got) == sorted(want, key=list(got).index)  # every tensor, nothing else
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert got[name].view(-1).view(__import__("torch").uint8).equal(
            t.reshape(-1).view(__import__("torch").uint8)), name


@pytest.mark.parametrize("where", ["directory", "s3"])
def test_a_stored_checkpoint_reads_back_byte_for_byte_in_ranges(
        where: str, ckpt: pathlib.Path, uploaded: str, aws) -> None:  # noqa: ANN001
    url = str(ckpt) if where == "directory" else uploaded
    opts = StorageOptions(concurrency=4, range_bytes=16 << 10)  # many ranges, some shared
    with open_storage(url, opts) as storage:
        layout, got = read_checkpoint(storage, opts)
        # each file once: its header (two reads), then its data
        assert storage.bytes_read == sum(f.size for f in layout.files)
    assert [f.name for f in layout.files] == sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert len(layout.files) > 1
    _same(got, load_checkpoint(ckpt))
    if where == "s3":  # the server, counting, agrees
        assert aws.stats()["body_bytes"] == sum(f.size for f in layout.files)


def test_the_watermark_only_covers_landed_bytes_and_a_held_prefix_is_not_read_again(
        ckpt: pathlib.Path, uploaded: str, aws) -> None:  # noqa: ANN001
    import torch

    opts = StorageOptions(concurrency=3, range_bytes=8 << 10)
    with open_storage(uploaded, opts) as storage:
        layout = read_layout(storage)
        want = load_checkpoint(ckpt)
        dest = allocate_slab(layout.specs())
        ends, names = [], []
        flat = b"".join(want[t.name].reshape(-1).view(torch.uint8).numpy().tobytes()
                        for t in layout.tensors)

        def publish(mark: int) -> None:
            # at each advance, every byte below the mark is there already
            have = b"".join(dest[t.name].reshape(-1).view(torch.uint8).numpy().tobytes()
                            for t in layout.tensors)
            assert have[:mark] == flat[:mark]
            ends.append(mark)

        reader = StorageReader(storage, layout, opts, publish=publish,
                               tensor_done=names.append)
        reader.read_into(dest)
        assert ends == sorted(ends) and ends[-1] == layout.total_bytes and len(ends) > 10
        assert names == [t.name for t in layout.tensors]
        # a second destination that already holds the first 40% reads only the rest
        half = ends[len(ends) * 2 // 5]
        again = allocate_slab(layout.specs())
        for t in layout.tensors:
            again[t.name].copy_(dest[t.name])
        before = storage.bytes_read
        resumed = StorageReader(storage, layout, opts, have=half)
        resumed.read_into(again)
        assert storage.bytes_read - before == layout.total_bytes - half == resumed.bytes_read
    _same(again, want)


def test_range_sizes_follow_the_model_size() -> None:
    assert range_bytes_for(90 << 20, 8 << 20) == 512 << 10
    assert range_bytes_for(1 << 20, 8 << 20) == 256 << 10
    assert range_bytes_for(16 << 30, 8 << 20) == 8 << 20
    with pytest.raises(ConfigError, match="concurrency"):
        StorageOptions(concurrency=0)


def test_a_missing_prefix_or_object_is_one_line_naming_it(uploaded: str, aws) -> None:  # noqa: ANN001
    with open_storage(f"s3://{BUCKET}/models/nothing-here") as storage, \
            pytest.raises(ConfigError, match="holds no \\*.safetensors"):
        storage.files()
    with open_storage(f"s3://{BUCKET}/models/small/gone.safetensors") as storage, \
            pytest.raises(StorageReadError, match="no such object") as err:
        storage.files()
    assert "\n" not in str(err.value) and "gone.safetensors" in str(err.value)
    with open_storage(f"s3://mx-no-such-bucket/m") as storage, \
            pytest.raises(StorageReadError, match="no such bucket"):
        storage.files()
    with pytest.raises(ConfigError, match="not an S3 URL"):
        open_storage("s3:///nobucket")
    with pytest.raises(ConfigError, match="unsupported storage URL"):
        open_storage("gs://bucket/m")


def test_access_denied_is_one_line_that_says_which_credentials_to_check(
        uploaded: str, aws) -> None:  # noqa: ANN001
    aws.faults(deny=[f"{BUCKET}/models/small/model-00002"])
    with open_storage(uploaded) as storage:
        layout_files = storage.files()  # the listing is allowed
        with pytest.raises(StorageReadError, match="access denied") as err:
            read_layout(storage)
    assert "AWS_ACCESS_KEY_ID" in str(err.value) and "\n" not in str(err.value)
    assert len(layout_files) > 1


def test_a_truncated_object_is_refused_from_its_header_before_any_byte_loads(
        ckpt: pathlib.Path, s3, aws, tmp_path: pathlib.Path) -> None:  # noqa: ANN001
    first = sorted(ckpt.glob("*.safetensors"))[0]
    data = first.read_bytes()
    s3.client().put_object(Bucket=BUCKET, Key="models/cut/model.safetensors",
                           Body=data[:len(data) - 1000])
    with open_storage(f"s3://{BUCKET}/models/cut") as storage, \
            pytest.raises(CheckpointError, match="truncated") as err:
        read_layout(storage)
    assert "upload it again" in str(err.value)
    (tmp_path / "cut.safetensors").write_bytes(data[:6])
    with open_storage(str(tmp_path / "cut.safetensors")) as storage, \
            pytest.raises(CheckpointError, match="too short"):
        read_layout(storage)


def test_a_body_cut_short_every_time_fails_after_one_more_try_and_nothing_counts_as_read(
        uploaded: str, aws) -> None:  # noqa: ANN001
    opts = StorageOptions(concurrency=2, range_bytes=16 << 10)
    with open_storage(uploaded, opts) as storage:
        layout = read_layout(storage)
        key = f"{BUCKET}/models/small/{layout.files[0].name}"
        aws.faults(truncate={key: 40_000})  # the connection "drops" 40 kB into the object
        marks: list[int] = []
        with pytest.raises(StorageReadError, match="twice") as err:
            StorageReader(storage, layout, opts, publish=marks.append).read_into(
                allocate_slab(layout.specs()))
    assert "\n" not in str(err.value)
    assert not marks or marks[-1] < 40_000  # the mark never passed the missing bytes


def test_a_slow_endpoint_times_out_with_the_setting_to_change(uploaded: str, aws) -> None:  # noqa: ANN001
    opts = StorageOptions(timeout_s=0.5)
    aws.faults(delay_s=2.0)
    t0 = time.monotonic()
    with open_storage(uploaded, opts) as storage, \
            pytest.raises(StorageReadError, match="MX_STORAGE_TIMEOUT_S") as err:
        storage.files()
    assert time.monotonic() - t0 < 30  # bounded: three tries of 0.5 s, plus backoff
    assert "slow or unreachable" in str(err.value)
