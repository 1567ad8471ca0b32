"""shardgather.layouts on its own (no group): boxes that fit and boxes that do not."""

import pytest
import torch

from shardgather.layouts import Box, TensorLayout


def test_a_layout_whose_boxes_fit_validates():
    TensorLayout((4, 2), torch.float32, [(0, Box((0, 0), (4, 2)))],
                 [(1, Box((2, 1), (2, 1))), (2, Box((4, 0), (0, 2)))]).validate()


@pytest.mark.parametrize("box", [Box((0, 0), (5, 2)), Box((0,), (4,)), Box((-1, 0), (1, 2))])
def test_a_box_that_does_not_fit_is_named(box):
    with pytest.raises(ValueError, match=r"destinations\[0\] \(rank 3\)"):
        TensorLayout((4, 2), torch.float32, [], [(3, box)]).validate()
