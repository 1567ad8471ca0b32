"""Layouts for :class:`shardgather.ReshardPlan` (docs/reshard.md): per tensor, its global shape
and dtype and the boxes each rank holds (sources) and wants (destinations)."""

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = ["Box", "TensorLayout"]


class Box(NamedTuple):
    """An N-d box of a global tensor: the elements offset[d] <= x[d] < offset[d] + size[d].
    A 0-d tensor's box has no dims."""

    offset: tuple
    size: tuple


@dataclass
class TensorLayout:
    """One tensor's two layouts: ``sources`` and ``destinations`` are lists of (rank, Box)."""

    shape: tuple
    dtype: torch.dtype
    sources: list = field(default_factory=list)
    destinations: list = field(default_factory=list)

    def validate(self):
        """ValueError naming the entry whose box does not fit the shape."""
        for side in ("sources", "destinations"):
            for k, (rank, box) in enumerate(getattr(self, side)):
                offset, size = box
                fits = len(offset) == len(self.shape) == len(size) and all(
                    0 <= o and 0 <= n and o + n <= s for o, n, s in zip(offset, size, self.shape))
                if not fits:
                    raise ValueError("%s[%d] (rank %d): box %s does not fit shape %s"
                                     % (side, k, rank, tuple(box), tuple(self.shape)))
