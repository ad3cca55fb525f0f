"""The trainer side of vLLM's weight-transfer API for the ``mx`` backend.

::

    trainer process                                 each vLLM engine (worker)
    ----------------------------------------------  --------------------------------------
    engine = WeightTransferTrainerFactory.trainer_init(
        MxTrainerInitInfo(model="run-7", rank=0),
        client=FanOutClient([http_client_a, ...]),
        source=ModuleSource(model))
      -> init_weight_transfer_engine({"model": ...})  MxWeightTransferEngine: control plane
    engine.send_weights()          # version 1, 2, ...
      pool.publish(v, source)      # host slot, READY source "run-7"@v
      per engine, concurrently:
        start_weight_update        -> (nothing: the old weights stay)
        update_weights({"version": v, "identities": [...]})
                                   -> pull v into staging, digests checked,
                                      then vLLM's own load_weights + post-processing
        finish_weight_update(weight_version=v)
      an engine that failed keeps its previous weights; WeightUpdateError names it

This module imports vLLM (its base classes); :mod:`modelexpress.rl.versions` does not.
The ``WeightSource`` interface differs between vLLM 0.32 (``__iter__``,
``held_names()``) and 0.33 (``iter_full()``, ``owned_names(rank)``): :func:`held_items`
is the one place that tells them apart.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from modelexpress.errors import ConfigError, WeightUpdateError
from modelexpress.rl.versions import PublishedVersion, VersionPool, version_identity

__all__ = ["BACKEND", "FanOutClient", "StateDictSource", "MxTrainerInitInfo", "MxTrainerWeightTransferEngine",
           "SendReport", "held_items"]

log = logging.getLogger(__name__)

BACKEND = "mx"


def held_items(source: WeightSource, rank: int) -> Iterator[tuple[str, Any]]:
    """The ``(name, full tensor)`` pairs this trainer rank holds, in the source's order.

    Every rank iterates (materializing may be a collective among the ranks that share
    a parameter); pairs it does not hold are dropped.
    """
    if _SOURCE_033:  # iter_full yields exactly what this rank owns: iter_full yields exactly what is owned
        yield from source.iter_full()
        return
    for name, tensor in source:  # vLLM 0.32: None stands for a name another rank holds
        if tensor is not None:
            yield name, tensor


# vLLM 0.33 made `metadata` a cached property and iteration `iter_full()`; 0.32 has a
# `metadata()` method and `__iter__`. The one gate between the two source shapes:
_SOURCE_033 = hasattr(WeightSource, "iter_full")


class StateDictSource(WeightSource):
    """A ``WeightSource`` over ``name -> tensor`` (a state dict as the trainer holds it),
    for trainers without an ``nn.Module`` of the whole model (vLLM's ``ModuleSource``
    covers those that have one). Works with vLLM 0.32 and 0.33.

    Args:
        tensors: the mapping; read afresh on every pass, so in-place updates are sent.
    """

    def __init__(self, tensors: Mapping[str, Any]) -> None:
        self._tensors = tensors

    def _meta(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._tensors.items()]

    if _SOURCE_033:
        @functools.cached_property
        def metadata(self) -> list[ParamMeta]:  # type: ignore[override]
            return self._meta()

        def iter_full(self) -> Iterator[tuple[str, Any]]:
            yield from self._tensors.items()

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            return self.iter_full()
    else:
        def metadata(self) -> list[ParamMeta]:  # type: ignore[override]
            return self._meta()

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            yield from self._tensors.items()


@dataclasses.dataclass
class MxTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``mx`` backend.

    Attributes:
        model: the run's name; every version is published under it (identity ``model``).
        server_url: control plane the engines reach, sent to them at init; None: each
            engine uses its own ``MX_SERVER_URL``. The trainer itself uses
            ``MX_SERVER_URL`` / ``MX_SERVER_TOKEN`` unless a client is given.
        slots: versions kept published (host buffers reused; see ``VersionPool``).
        shards: how many trainer ranks publish a part of the model (rank ``r < shards``
            publishes the names it holds). 1: rank 0 publishes everything.
        first_version: the version ``send_weights()`` without an argument sends first.
        update_timeout_s: bound on one engine's update round trip.
    """

    backend: ClassVar[str] = BACKEND

    model: str = "mx-rl"
    server_url: str | None = None
    slots: int = 2
    shards: int = 1
    first_version: int = 1
    update_timeout_s: float = 600.0


@dataclasses.dataclass(frozen=True)
class SendReport:
    """What one :meth:`MxTrainerWeightTransferEngine.send_weights` did.

    Attributes:
        version: the version sent.
        published: this rank's publish (None on a rank that publishes nothing).
        engine_seconds: per engine (its index in the fan-out), its update round trip.
        seconds: from the call to the last engine finished.
    """

    version: str
    published: PublishedVersion | None
    engine_seconds: tuple[float, ...]
    seconds: float


class FanOutClient:
    """Several engines driven as one: each member's round trip runs in its own thread.

    Args:
        members: ``VLLMWeightSyncClient`` objects (vLLM's ``HTTPVLLMWeightSyncClient``,
            ``RayVLLMWeightSyncClient``, or anything with the four methods).
    """

    def __init__(self, members: Sequence[VLLMWeightSyncClient]) -> None:
        if not members:
            raise ConfigError("a FanOutClient needs at least one engine client")
        self.members = list(members)

    def _all(self, method: str, *args: Any) -> None:
        with concurrent.futures.ThreadPoolExecutor(len(self.members)) as pool:
            futures = [pool.submit(getattr(m, method), *args) for m in self.members]
            for f in futures:
                f.result()

    # The VLLMWeightSyncClient protocol, for callers that use this as one client.
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", weight_version)


class MxTrainerWeightTransferEngine(TrainerWeightTransferEngine[MxTrainerInitInfo]):
    """Publishes weight versions and switches the engines to them (module docstring)."""

    init_info_cls = MxTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None,
                 is_sender: bool, init_info: MxTrainerInitInfo, pool: VersionPool | None,
                 ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self.pool = pool
        self._next = init_info.first_version

    @classmethod
    def trainer_init(cls, init_info: MxTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None,
                     mx_client: Any = None) -> MxTrainerWeightTransferEngine:
        """Open this rank's version pool and, on the sender, tell the engines where to pull.

        Args:
            init_info: :class:`MxTrainerInitInfo`.
            client: the engines' control plane (a :class:`FanOutClient` for several).
            source: the trainer's weights (``ModuleSource(model)`` or any ``WeightSource``).
            mx_client: the modelexpress control-plane client; built from ``MxSettings``
                (``MX_SERVER_URL``...) when None.

        Raises:
            ConfigError: no source, bad init info, or an invalid ``MX_*`` value.
        """
        if source is None:
            raise ConfigError("the mx backend resends the whole model each round: pass "
                              "source=ModuleSource(model) (or any WeightSource)")
        if init_info.shards < 1:
            raise ConfigError(f"shards must be >= 1 (got {init_info.shards})")
        from modelexpress.local import LocalOptions
        from modelexpress.settings import MxSettings

        settings = MxSettings.load()
        pool = None
        if init_info.rank < init_info.shards:
            if mx_client is None:
                from modelexpress.client import MxClient

                url = init_info.server_url or settings.server_url
                mx_client = MxClient.from_settings(settings.model_copy(update={"server_url": url}))
            pool = VersionPool(mx_client, init_info.model, slots=init_info.slots,
                               shard=init_info.rank, shards=init_info.shards,
                               heartbeat_interval_s=settings.heartbeat_interval_s,
                               backend=settings.nixl_backend,
                               local=LocalOptions.from_settings(settings))
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     init_info=init_info, pool=pool)
        if engine.is_sender:
            info: dict[str, Any] = {"model": init_info.model}
            if init_info.server_url:
                info["server_url"] = init_info.server_url
            client.init_weight_transfer_engine(info)
        return engine

    def send_weights(self, version: str | int | None = None) -> SendReport:  # type: ignore[override]
        """Publish the source's current weights as ``version`` and switch every engine to it.

        Called on every trainer rank (each publishes what it holds; with several
        shards the ranks must meet in a barrier before the sender drives the engines:
        ``torch.distributed.barrier()`` when a process group exists).

        Args:
            version: the version's name; the next integer when None.

        Returns:
            A :class:`SendReport`.

        Raises:
            WeightUpdateError: one or more engines did not switch (they keep their
                previous weights; the message names each with its reason).
        """
        t0 = time.perf_counter()
        if version is None:
            version = self._next
        version = str(version)
        if version.isdigit():
            self._next = int(version) + 1
        assert self.source is not None
        items = held_items(self.source, self.init_info.rank)
        published = None
        if self.pool is not None:
            published = self.pool.publish(version, items)
        else:
            for _ in items:  # keep the collectives of the iteration aligned
                pass
        if self.init_info.shards > 1:
            _barrier()
        seconds: tuple[float, ...] = ()
        if self.is_sender:
            seconds = self._update_engines(version)
        return SendReport(version, published, seconds, time.perf_counter() - t0)

    def _update_engines(self, version: str) -> tuple[float, ...]:
        n = self.init_info.shards
        identities = [version_identity(self.init_info.model, version, shard=i, shards=n)
                      for i in range(n)]
        update = {"version": version, "identities": [i.to_dict() for i in identities]}
        members = (self.client.members if isinstance(self.client, FanOutClient)
                   else [self.client])

        def round_trip(member: VLLMWeightSyncClient) -> float:
            started = time.perf_counter()
            member.start_weight_update()
            member.update_weights(update)
            member.finish_weight_update(weight_version=version)
            return time.perf_counter() - started

        lease = self.pool.lease(version) if self.pool is not None else _null()
        with lease, concurrent.futures.ThreadPoolExecutor(len(members)) as threads:
            futures = [threads.submit(round_trip, m) for m in members]
            done, _ = concurrent.futures.wait(futures, timeout=self.init_info.update_timeout_s)
            failures, seconds = [], []
            for i, f in enumerate(futures):
                if f not in done:
                    failures.append(f"engine {i}: no answer within "
                                    f"{self.init_info.update_timeout_s:.0f} s")
                    seconds.append(float("nan"))
                elif f.exception() is not None:
                    failures.append(f"engine {i}: {_describe(f.exception())}")
                    seconds.append(float("nan"))
                else:
                    seconds.append(f.result())
        if failures:
            raise WeightUpdateError(
                f"{len(failures)} of {len(members)} engines did not switch to "
                f"{self.init_info.model} version {version} and keep their previous weights: "
                + "; ".join(failures))
        log.info("%s version %s: %d engines switched in %s s", self.init_info.model, version,
                 len(members), ", ".join(f"{s:.3f}" for s in seconds))
        return tuple(seconds)

    def shutdown(self) -> None:
        """Withdraw every published version. Idempotent."""
        if self.pool is not None:
            self.pool.close()


def _describe(exc: BaseException) -> str:
    """An engine's error with the body of an HTTP answer (vLLM puts its reason there)."""
    response = getattr(exc, "response", None)
    body = getattr(response, "text", "") if response is not None else ""
    return f"{type(exc).__name__}: {exc}" + (f" ({body[:2000]})" if body else "")


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
