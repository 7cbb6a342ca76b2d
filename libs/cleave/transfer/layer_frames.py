"""Which layers a KV chunk carries, on both ends: ranges in headers, coalescing, bookkeeping.

A chunk header names `layer_index` and `num_layers` (0 or 1: one layer), i.e. the layer
range `[layer_index, layer_index + num_layers)`. The sender merges runs of consecutive
layers that are ready together into one chunk (`coalesce`); both ends count layers with a
`LayerLedger`, which refuses a layer outside the model or one that comes twice, and says
when a chunk completes the transfer (`is_last`). Nothing here touches a device.
"""

from __future__ import annotations

from collections.abc import Iterable

from cleave.errors import InvalidArgument
from cleave.proto.cleave.v1 import common_pb2


def header_layers(header: common_pb2.KVChunkHeader) -> range:
    """The layers a chunk carries."""
    return range(header.layer_index, header.layer_index + max(header.num_layers, 1))


def coalesce(spans: Iterable[range]) -> list[range]:
    """Merge consecutive spans that continue one another, keeping their order.

    [0:2], [2:3], [5:6], [6:8] -> [0:3], [5:8]
    """
    merged: list[range] = []
    for span in spans:
        if merged and merged[-1].stop == span.start:
            merged[-1] = range(merged[-1].start, span.stop)
        else:
            merged.append(span)
    return merged


class LayerLedger:
    """The layers of one transfer accounted so far (sent, or arrived).

    Args:
        num_layers: layers of the model; every one must be accounted exactly once.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._done = bytearray(num_layers)
        self.num_done = 0

    @property
    def is_complete(self) -> bool:
        return self.num_done == self.num_layers

    @property
    def num_missing(self) -> int:
        return self.num_layers - self.num_done

    def check(self, layers: range, field: str = "layer") -> None:
        """Raise InvalidArgument unless `layers` is a non-empty range of new layers."""
        if len(layers) == 0 or layers.step != 1:
            raise InvalidArgument(f"layers {layers.start}..{layers.stop - 1} are not a run of layers", field=field)
        if layers.start < 0 or layers.stop > self.num_layers:
            bad = layers.start if layers.start < 0 else layers.stop - 1
            raise InvalidArgument(f"layer {bad} outside [0, {self.num_layers})", field=field)
        for layer in layers:
            if self._done[layer]:
                raise InvalidArgument(f"layer {layer} arrived twice (or was already sent)", field=field)

    def completes(self, layers: range) -> bool:
        """Whether accounting `layers` (checked) would complete the transfer."""
        return self.num_done + len(layers) == self.num_layers

    def add(self, layers: range, field: str = "layer") -> None:
        """Account `layers` (raises like `check`)."""
        self.check(layers, field)
        for layer in layers:
            self._done[layer] = 1
        self.num_done += len(layers)
