"""Specification of ``TrainData``: the stream order, data-parallel sharding, the two micro-batch modes, the
overlong rule, counters and exact resume; and ``build_train_data``'s config contract."""

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from thdpack.data import IGNORE_INDEX, Sample, TrainData, build_train_data

PAD = 999


class Numbered:
    """Sample ``i`` is ``lengths[i]`` copies of ``i``: a row's first token says which sample it holds."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return Sample(np.full(self.lengths[i], i, dtype=np.int64), None, f"numbered:{i}")


def make(dataset, **kw):
    args = dict(
        seq_length=16, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0, pad_id=PAD
    )
    return TrainData(dataset, **{**args, **kw})


def ids(batches):
    """Sample ids of each micro-batch, in row order."""
    return [b["tokens"][:, 0].tolist() for b in batches]


def flat(batches):
    return [i for mb in ids(batches) for i in mb]


def test_fixed_micro_batches_follow_megatrons_rank_interleaving():
    kw = dict(global_batch_size=8, micro_batch_size=2, dp_size=2, shuffle=False)
    assert ids(make(Numbered([3] * 20), dp_rank=0, **kw).next_step()) == [[0, 1], [4, 5]]
    assert ids(make(Numbered([3] * 20), dp_rank=1, **kw).next_step()) == [[2, 3], [6, 7]]


def test_num_microbatches_is_global_batch_over_micro_batch_times_dp():
    data = make(Numbered([3] * 50), global_batch_size=24, micro_batch_size=3, dp_size=2)
    assert len(data.next_step()) == 4 == data.num_microbatches_last


@pytest.mark.parametrize("budget", [None, 20])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_ranks_are_disjoint_and_their_union_is_the_global_batch(dp, budget):
    lengths = np.random.default_rng(1).integers(1, 17, 37)
    kw = dict(global_batch_size=8, micro_batch_size=2, micro_batch_tokens=budget, dp_size=dp)
    ranks = [make(Numbered(lengths), dp_rank=r, **kw) for r in range(dp)]
    reference = make(Numbered(lengths), **{**kw, "dp_size": 1, "micro_batch_size": 8})
    for _ in range(6):  # crosses epoch boundaries (37 samples)
        shares = [flat(rank.next_step()) for rank in ranks]
        union = [i for share in shares for i in share]
        assert len(union) == len(set(union)) == 8
        assert sorted(union) == sorted(flat(reference.next_step()))


def test_shuffle_false_reads_the_dataset_in_order_across_epochs():
    data = make(Numbered([2] * 5), global_batch_size=4, micro_batch_size=4, shuffle=False)
    assert flat(data.next_step()) == [0, 1, 2, 3]
    assert flat(data.next_step()) == [4, 0, 1, 2]
    assert data.epoch == 1


def test_each_epoch_is_a_new_permutation_of_the_dataset():
    data = make(Numbered([2] * 10), global_batch_size=5, micro_batch_size=5)
    stream = [i for _ in range(4) for i in flat(data.next_step())]
    first, second = stream[:10], stream[10:]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second and first != list(range(10))


def test_the_same_seed_gives_the_same_batches_and_another_seed_others():
    def run(seed):
        data = make(Numbered(np.arange(1, 31) % 16 + 1), seed=seed)
        return [flat(data.next_step()) for _ in range(3)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_the_order_is_a_permutation_from_seed_and_epoch():
    data = make(Numbered([2] * 10), global_batch_size=10, micro_batch_size=10, seed=3)
    assert flat(data.next_step()) == np.random.default_rng([3, 0]).permutation(10).tolist()


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


@pytest.mark.parametrize(
    "kw",
    [
        dict(dp_size=2, dp_rank=1),
        dict(dp_size=2, dp_rank=0, micro_batch_tokens=24, pad_to="longest"),
        dict(dp_size=1, overlong="drop", shuffle=False),
        dict(dp_size=2, dp_rank=1, overlong="truncate", mrope=True),
    ],
    ids=["fixed", "budget", "drop", "truncate-mrope"],
)
def test_resume_continues_with_exactly_the_batches_of_an_uninterrupted_run(kw):
    lengths = np.random.default_rng(2).integers(1, 24, 23)  # some longer than seq_length 16
    uninterrupted = make(Numbered(lengths), **kw)
    expected = [uninterrupted.next_step() for _ in range(7)]
    first = make(Numbered(lengths), **kw)
    for _ in range(3):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    resumed = make(Numbered(lengths), **kw)
    resumed.load_state_dict(state)
    for step in range(3, 7):
        assert_same_batches(resumed.next_step(), expected[step])
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_state_dict_is_python_ints_and_the_same_on_every_rank():
    kw = dict(dp_size=2, micro_batch_tokens=20)
    ranks = [make(Numbered(np.arange(40) % 16 + 1), dp_rank=r, **kw) for r in range(2)]
    for rank in ranks:
        rank.next_step()
        rank.next_step()
    states = [rank.state_dict() for rank in ranks]
    assert states[0] == states[1]
    assert all(type(v) is int for v in states[0].values())
    assert states[0]["consumed"] == states[0]["samples_seen"] == 16
    assert states[0]["steps"] == 2


def test_load_state_dict_refuses_another_seed_or_dataset():
    state = make(Numbered([2] * 10)).state_dict()
    with pytest.raises(ValueError, match="seed=0 but this run has seed=1"):
        make(Numbered([2] * 10), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_size=10 but this run has dataset_size=11"):
        make(Numbered([2] * 11)).load_state_dict(state)


def test_overlong_truncate_keeps_the_first_tokens_and_counts():
    data = make(Numbered([20, 5, 16, 17]), global_batch_size=4, micro_batch_size=4, shuffle=False)
    batch = data.next_step()[0]
    assert batch["attention_mask"].sum(1).tolist() == [16, 5, 16, 16]
    assert (data.truncated, data.dropped, data.real_tokens) == (2, 0, 53)


def test_overlong_drop_skips_and_the_stream_refills_the_batch():
    data = make(
        Numbered([20, 5, 16, 17, 3, 4]),
        global_batch_size=4,
        micro_batch_size=4,
        shuffle=False,
        overlong="drop",
    )
    assert flat(data.next_step()) == [1, 2, 4, 5]
    assert (data.dropped, data.truncated, data.consumed, data.samples_seen) == (2, 0, 6, 4)


def test_overlong_error_names_the_source_and_the_lengths():
    data = make(Numbered([5, 20]), global_batch_size=2, micro_batch_size=2, shuffle=False, overlong="error")
    with pytest.raises(ValueError, match=r"numbered:1: sample of 20 tokens is longer than seq_length \(16\)"):
        data.next_step()


def test_a_step_that_raises_leaves_the_state_unchanged():
    data = make(
        Numbered([5, 5, 5, 20]), global_batch_size=2, micro_batch_size=2, shuffle=False, overlong="error"
    )
    data.next_step()
    before = data.state_dict()
    with pytest.raises(ValueError):
        data.next_step()
    assert data.state_dict() == before


def test_truncation_that_leaves_no_target_drops_the_sample():
    class ResponseLast(Numbered):
        def __getitem__(self, i):  # SFT-like: only the last 3 tokens are targets
            s = super().__getitem__(i)
            return Sample(s.tokens, np.arange(len(s.tokens)) >= len(s.tokens) - 3, s.source)

    # seq_length 16: length 20 and 19 lose every target (dropped), 17 keeps two (truncated)
    data = make(ResponseLast([20, 17, 3, 19, 4]), global_batch_size=2, micro_batch_size=2, shuffle=False)
    assert flat(data.next_step()) == [1, 2]
    assert flat(data.next_step()) == [4, 1]
    assert (data.truncated, data.dropped) == (2, 3)


def test_when_no_sample_fits_drop_says_so_instead_of_looping():
    data = make(Numbered([20, 30]), global_batch_size=2, micro_batch_size=2, overlong="drop")
    with pytest.raises(ValueError, match="no sample of the dataset fits"):
        data.next_step()


def test_budget_micro_batches_respect_the_budget_and_match_across_ranks():
    lengths = np.random.default_rng(3).integers(1, 17, 64)
    ranks = [
        make(Numbered(lengths), dp_rank=r, dp_size=2, global_batch_size=16, micro_batch_tokens=24)
        for r in range(2)
    ]
    for _ in range(4):
        steps = [rank.next_step() for rank in ranks]
        assert (
            len(steps[0]) == len(steps[1]) == ranks[0].num_microbatches_last == ranks[1].num_microbatches_last
        )
        for step, rank in zip(steps, ranks, strict=True):
            assert all(b["attention_mask"].sum() <= 24 for b in step)
            assert sum(int(b["attention_mask"].sum()) for b in step) == rank.rank_tokens_last


def test_the_budget_caps_sample_length_when_smaller_than_seq_length():
    data = make(
        Numbered([12, 3]), global_batch_size=2, micro_batch_tokens=10, shuffle=False, overlong="error"
    )
    with pytest.raises(ValueError, match=r"longer than micro_batch_tokens \(10\)"):
        data.next_step()


def test_a_filler_micro_batch_is_one_masked_pad_token():
    # three samples that fit no two together, two ranks: one rank gets an empty second micro-batch
    kw = dict(
        global_batch_size=3, micro_batch_tokens=10, seq_length=10, dp_size=2, shuffle=False, pad_to="longest"
    )
    steps = [make(Numbered([10, 10, 1]), dp_rank=r, **kw).next_step() for r in range(2)]
    fillers = [b for step in steps for b in step if b["tokens"].tolist() == [[PAD]]]
    assert len(fillers) == 1
    assert fillers[0]["labels"].tolist() == [[IGNORE_INDEX]]
    assert fillers[0]["loss_mask"].tolist() == [[0.0]]
    assert fillers[0]["attention_mask"].tolist() == [[1]]  # a real one-token row: the packer needs a sample


def test_batches_carry_mrope_ids_and_pad_to_longest_when_asked():
    data = make(Numbered([3, 5]), global_batch_size=2, micro_batch_size=2, mrope=True, pad_to="longest")
    batch = data.next_step()[0]
    assert batch["tokens"].shape == (2, 5)
    assert batch["mrope_position_ids"].shape == (3, 2, 5)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (
            dict(global_batch_size=10, micro_batch_size=2, dp_size=2),
            r"global_batch_size \(10\).*micro_batch_size \(2\)",
        ),
        (dict(micro_batch_size=None), "micro_batch_size"),
        (
            dict(micro_batch_tokens=8, global_batch_size=1, dp_size=2),
            r"global_batch_size \(1\) < dp_size \(2\)",
        ),
        (dict(overlong="clip"), "overlong is 'clip'"),
        (dict(pad_to="bucket"), "pad_to is 'bucket'"),
        (dict(dp_rank=2, dp_size=2), "dp_rank 2"),
    ],
)
def test_bad_settings_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        make(Numbered([2] * 4), **kw)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "sft.jsonl"
    lines = [{"prompt": f"q{i}", "response": "a" * (i + 1)} for i in range(10)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


RECIPE = dict(
    name="jsonl",
    tokenizer="byte",
    seq_length=32,
    micro_batch_size=2,
    global_batch_size=4,
    micro_batch_tokens=None,
    shuffle=True,
    overlong="truncate",
    pad_to="seq_length",
    pack_sequences_in_batch=True,
    mode="auto",
    mrope=False,
    some_future_key=1,
)


def test_build_train_data_reads_a_recipe_and_ignores_keys_it_does_not_own(jsonl):
    data = build_train_data({**RECIPE, "path": jsonl}, dp_rank=1, dp_size=2, seed=0)
    batches = data.next_step()
    assert len(batches) == 1 and batches[0]["tokens"].shape == (2, 32)
    assert data.tokenizer.vocab_size == 259 and data.pad_id == data.tokenizer.pad_id


def test_build_train_data_takes_an_omegaconf_mapping(jsonl):
    cfg = OmegaConf.create({**RECIPE, "path": jsonl, "micro_batch_tokens": 64})
    assert build_train_data(cfg, dp_rank=0, dp_size=1, seed=0).micro_batch_tokens == 64


def test_build_train_data_names_a_missing_required_key(jsonl):
    recipe = {k: v for k, v in RECIPE.items() if k != "global_batch_size"}
    with pytest.raises(ValueError, match="required key 'global_batch_size'"):
        build_train_data({**recipe, "path": jsonl}, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="dataset.path is required for dataset.name=jsonl"):
        build_train_data(RECIPE, dp_rank=0, dp_size=1, seed=0)


def test_micro_batch_size_is_optional_with_a_token_budget(jsonl):
    recipe = {k: v for k, v in RECIPE.items() if k != "micro_batch_size"}
    data = build_train_data({**recipe, "path": jsonl, "micro_batch_tokens": 64}, dp_rank=0, dp_size=1, seed=0)
    assert all(int(b["attention_mask"].sum()) <= 64 for b in data.next_step())


def test_build_train_data_names_an_unknown_dataset():
    with pytest.raises(ValueError, match="dataset.name is 'c4'"):
        build_train_data({**RECIPE, "name": "c4"}, dp_rank=0, dp_size=1, seed=0)


def test_build_train_data_on_the_embedded_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("THDPACK_CACHE", str(tmp_path))
    recipe = {**RECIPE, "name": "embedded", "max_files": 10, "seq_length": 256, "micro_batch_tokens": 512}
    data = build_train_data(recipe, dp_rank=0, dp_size=2, seed=0)
    for _ in range(3):
        for batch in data.next_step():
            assert batch["tokens"][0, 0] == data.tokenizer.bos_id
    assert data.samples_seen == 12 and data.truncated > 0


def test_build_train_data_takes_the_dataset_group_of_a_shipped_recipe(tmp_path, monkeypatch):
    # micro_batch_tokens: auto in the shipped recipe means micro_batch_size x seq_length tokens when packing.
    from hydra import compose, initialize_config_dir

    from thdpack.training.loop import recipes_dir

    monkeypatch.setenv("THDPACK_CACHE", str(tmp_path))
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["dataset.max_files=10"])
    assert cfg.dataset.micro_batch_tokens == "auto"
    data = build_train_data(cfg.dataset, dp_rank=0, dp_size=1, seed=0)
    assert data.micro_batch_tokens == cfg.dataset.micro_batch_size * cfg.dataset.seq_length
    assert sum(int(b["attention_mask"].sum()) for b in data.next_step()) > 0
