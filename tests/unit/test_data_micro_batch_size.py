"""``TrainData.largest_micro_batch_tokens``: the most tokens one micro-batch of the run's data can hold, which the
memory check sizes the activations by (thdpack.training.memory)."""

import numpy as np

from thdpack.data.loader import TrainData
from thdpack.data.samples import Sample


class Sized:
    """Samples of the given lengths, known up front."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return Sample(np.ones(int(self.lengths[i]), np.int64), source=f"sized:{i}")


def data(lengths, **kwargs) -> TrainData:
    args = dict(
        seq_length=100, global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0, pad_id=0
    )
    return TrainData(Sized(lengths), **{**args, **kwargs})


def test_a_token_budget_holds_at_most_the_longest_samples_of_one_global_batch():
    d = data([10, 60, 150, 20, 30, 5], micro_batch_tokens=800)
    assert d.largest_micro_batch_tokens(packed=True) == 100 + 60 + 30 + 20  # 150 cut to seq_length 100


def test_a_token_budget_below_the_data_is_the_bound():
    assert data([90, 90, 90, 90], micro_batch_tokens=128).largest_micro_batch_tokens(packed=True) == 128


def test_packed_fixed_micro_batches_hold_the_longest_micro_batch_size_samples():
    assert data([10, 60, 50, 20]).largest_micro_batch_tokens(packed=True) == 110


def test_padded_rows_are_seq_length_or_the_longest_sample_long():
    assert data([10, 60, 50]).largest_micro_batch_tokens(packed=False) == 2 * 100
    assert data([10, 60, 50], pad_to="longest").largest_micro_batch_tokens(packed=False) == 2 * 60


def test_unknown_lengths_give_no_bound():
    class Unsized(Sized):
        lengths = None

        def __init__(self):
            pass

        def __len__(self):
            return 4

    d = TrainData(
        Unsized(),
        seq_length=8,
        global_batch_size=4,
        micro_batch_size=2,
        dp_rank=0,
        dp_size=1,
        seed=0,
        pad_id=0,
    )
    assert d.largest_micro_batch_tokens(packed=True) is None
