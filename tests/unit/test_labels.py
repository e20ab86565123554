"""One rule for labels: a negative label is no target, whatever its value, and so is ignore_index."""

import numpy as np
import torch

from thdpack.packing.labels import IGNORE_INDEX, no_target


def test_every_negative_label_and_ignore_index_are_no_target():
    labels = torch.tensor([5, -100, -1, 0, 7])
    assert no_target(labels).tolist() == [False, True, True, False, False]
    assert no_target(labels, ignore_index=7).tolist() == [False, True, True, False, True]


def test_numpy_labels_follow_the_same_rule():
    labels = np.array([[3, IGNORE_INDEX, -2]])
    assert no_target(labels).tolist() == [[False, True, True]]
