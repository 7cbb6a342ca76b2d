"""Which slot of the KV cache tensor each attention layer uses, and over which block tables.

Most models give every layer a slot of its own: the cache is [num_layers, 2, num_blocks, ...]
and one block id names a token range's KV in every layer. A model that mixes full-attention
layers with as many layers sliding over one window W (gpt-oss alternates them) can instead
pair them: slot k holds the k-th full layer's KV in the pages of a sequence's block table
and the k-th sliding layer's in the pages of its window table, which drops pages behind the
window as the sequence grows (`KVCacheManager(window_group=True)`). A long generation then
holds its full layers' blocks and about W / block_size window pages, where one table over
every layer held twice its blocks.

    groups = kv_groups(model_config, pair_window_layers=True)
    cache = allocate_kv_cache(model_config, num_blocks, block_size, num_slots=groups.num_slots)
    for layer, (slot, window) in enumerate(groups.layers()):
        ... kv_cache[slot], metadata.window if window else metadata
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from cleave.model.config import ModelConfig


@dataclass(frozen=True)
class KVGroups:
    """The layer-to-slot plan of one model's KV cache.

    Attributes:
        layer_slots: each layer's slot in the cache tensor.
        window_layers: each layer's table: True reads the window tables (paired caches only).
        sliding_window: the window the KV manager drops pages behind: of every layer
            (uniform), of the window layers (paired), or None (keep every block).
    """

    layer_slots: tuple[int, ...]
    window_layers: tuple[bool, ...]
    sliding_window: int | None

    @property
    def num_slots(self) -> int:
        return max(self.layer_slots, default=-1) + 1

    @property
    def is_paired(self) -> bool:
        """Whether some layers read window tables (the manager needs a window group)."""
        return any(self.window_layers)

    def layers(self) -> Iterator[tuple[int, bool]]:
        """(slot, reads window tables) of each layer, in order."""
        return zip(self.layer_slots, self.window_layers)

    def slots_done_after(self, num_layers_done: int) -> int:
        """Slots whose every layer is among the first `num_layers_done` (a layer-by-layer
        KV stream can send those)."""
        last_layer: dict[int, int] = {}
        for layer, slot in enumerate(self.layer_slots):
            last_layer[slot] = layer
        done = 0
        while done < self.num_slots and last_layer[done] < num_layers_done:
            done += 1
        return done


def uniform_sliding_window(config: ModelConfig) -> int | None:
    """W when every attention layer sees only a query's last W positions (Mistral), else
    None: one full-attention layer (gpt-oss, Llama) reads every block the sequence has."""
    windows = {config.layer_sliding_window(layer) for layer in range(config.num_hidden_layers)}
    return windows.pop() if len(windows) == 1 else None


def kv_groups(config: ModelConfig, pair_window_layers: bool = True) -> KVGroups:
    """The cache plan for `config`: paired (see the module) when `pair_window_layers` and the
    model has as many layers sliding over one window as full-attention layers, else one slot
    per layer."""
    num_layers = config.num_hidden_layers
    windows = [config.layer_sliding_window(layer) for layer in range(num_layers)]
    full = [layer for layer, window in enumerate(windows) if not window]
    sliding = [layer for layer, window in enumerate(windows) if window]
    if not pair_window_layers or not full or len(full) != len(sliding) or len(set(map(windows.__getitem__, sliding))) != 1:
        return KVGroups(tuple(range(num_layers)), (False,) * num_layers, uniform_sliding_window(config))
    slots = [0] * num_layers
    for group in (full, sliding):
        for slot, layer in enumerate(group):
            slots[layer] = slot
    return KVGroups(tuple(slots), tuple(bool(window) for window in windows), windows[sliding[0]])
