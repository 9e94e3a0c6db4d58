"""The weight-transport interface and what every transport shares: the client it talks through,
the size-bounded buckets, the stats of one sync, and the stream type of the trainer's weights.

A transport takes full (unsharded) tensors under their on-disk Hugging Face names (Megatron -> HF
conversion and the TP/EP gather happen before, trainer-side) and issues the server calls of
``docs/sglang-protocol.md`` section 4 through a :class:`WeightUpdateClient`.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch


@dataclass
class SyncStats:
    """What one weight synchronisation moved."""

    weight_version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    num_buckets: int = 1

    @property
    def gigabytes_per_second(self) -> float:
        return self.num_bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")


class StableTensorStream(Iterator[tuple[str, Any]]):
    """``(name, tensor)`` pairs whose tensors stay valid and unchanged until the consumer that
    drains the stream has returned: fresh tensors nobody else writes, or views of a model that
    nothing updates meanwhile (the trainer's weight stream during a sync,
    ``engine.hf_import_export.iter_hf_weights``). A loader may therefore stage them by reference
    (``HFWeightLayout.stage(..., borrow=True)``) instead of copying them."""

    def __init__(self, pairs: Iterable[tuple[str, Any]]):
        self._pairs = iter(pairs)

    def __iter__(self) -> StableTensorStream:
        return self

    def __next__(self) -> tuple[str, Any]:
        return next(self._pairs)


class WeightUpdateClient(Protocol):
    """What a transport needs of the client of the servers it updates
    (``rollout.sglang_client.SGLangEngine``): their URLs, and calls that raise the client's
    engine error on a failed or refused answer. A client may also say whether an update should
    flush the servers' caches (``flushes_on_update``, read with a default of True)."""

    @property
    def urls(self) -> list[str]: ...

    request_timeout_s: float

    def post_json(
        self,
        url: str,
        path: str,
        payload: Any = None,
        *,
        timeout: Optional[float] = None,
        retry_timeouts: bool = True,
    ) -> Any: ...

    def post_all(
        self, path: str, payload: Any = None, *, timeout: Optional[float] = None
    ) -> list[Any]: ...


class WeightTransport(abc.ABC):
    """How :meth:`SGLangEngine.sync_weights` moves tensors to the servers."""

    name: str = "abstract"
    needs_bracket: bool = True
    """Whether SGLang 0.5.23 needs the ``/begin_weight_update`` ... ``/end_weight_update`` bracket
    around this transport's calls (tensor and distributed: yes, refused outside it)."""

    @abc.abstractmethod
    def sync(
        self,
        client: WeightUpdateClient,
        named_tensors: Iterator[tuple[str, torch.Tensor]],
        version: int,
    ) -> SyncStats:
        """Move every tensor to every server of ``client`` and set their weight version."""

    def resend(self, client: WeightUpdateClient) -> Optional[SyncStats]:
        """Send the newest weights again, without the trainer, to servers that lost them (a
        restarted server); None when this transport keeps no copy of them."""
        return None

    @property
    def latest_version(self) -> Optional[int]:
        """Version of the newest weights this transport holds a copy of (written, maybe not
        loaded by every server); None when it keeps none."""
        return None

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget per-server state after a server restarted (its update group): the next
        :meth:`sync` starts over with every server."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release process groups or files."""


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most ``bucket_bytes`` (a larger tensor travels
    alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def with_last_flag(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, is_last)``: looks one item ahead so the last bucket can flush and set the version."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True
