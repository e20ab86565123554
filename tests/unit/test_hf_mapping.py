"""thdpack.hf.mapping's layouts on tensors small enough to write out: one row per head (head_dim 1), values that
say where they came from (q heads 0..3, k 10.., v 20.., gate 0.., up 10..)."""

from __future__ import annotations

import pytest
import torch

from thdpack.hf.mapping import (
    COLUMN,
    GATED,
    QKV,
    ROW,
    VOCAB,
    Dims,
    Shard,
    active_rules,
    match_name,
    to_hf,
    to_megatron,
)

DIMS = Dims(heads=4, groups=2, head_dim=1, vocab=3)
Q, K, V = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])


def reader(*tensors):
    return lambda i, rows, cols: tensors[i][rows] if tensors[i].dim() == 1 else tensors[i][rows, cols]


def test_qkv_fuses_each_query_group_as_its_q_heads_then_k_then_v():
    fused = to_megatron(QKV, reader(Q, K, V), torch.Size([8]), Shard(), DIMS)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_qkv_gives_each_tensor_parallel_rank_whole_query_groups():
    ranks = [to_megatron(QKV, reader(Q, K, V), torch.Size([4]), Shard(r, 2), DIMS).tolist() for r in (0, 1)]
    assert ranks == [[0, 1, 10, 20], [2, 3, 11, 21]]


def test_gated_stacks_each_ranks_slice_of_gate_then_of_up():
    gate, up = torch.arange(4.0)[:, None], torch.arange(10.0, 14)[:, None]
    ranks = [to_megatron(GATED, reader(gate, up), torch.Size([4, 1]), Shard(r, 2), DIMS) for r in (0, 1)]
    assert [t.flatten().tolist() for t in ranks] == [[0, 1, 10, 11], [2, 3, 12, 13]]


def test_row_parallel_splits_columns():
    weight = torch.arange(8.0).reshape(2, 4)
    assert to_megatron(ROW, reader(weight), torch.Size([2, 2]), Shard(1, 2), DIMS).tolist() == [
        [2, 3],
        [6, 7],
    ]


def test_column_gives_each_rank_its_heads_rows_and_back():
    sinks = torch.tensor([0.0, 1, 2, 3])  # one value per attention head
    ranks = [to_megatron(COLUMN, reader(sinks), torch.Size([2]), Shard(r, 2), DIMS) for r in (0, 1)]
    assert [t.tolist() for t in ranks] == [[0, 1], [2, 3]]
    assert to_hf(COLUMN, torch.cat(ranks), DIMS)[0].tolist() == [0, 1, 2, 3]


def test_vocab_rows_past_the_checkpoint_are_zero_padding():
    embedding = torch.tensor([[1.0], [2.0], [3.0]])  # 3 ids; the model has 4 rows, 2 per rank
    ranks = [to_megatron(VOCAB, reader(embedding), torch.Size([2, 1]), Shard(r, 2), DIMS) for r in (0, 1)]
    assert [t.flatten().tolist() for t in ranks] == [[1, 2], [3, 0]]
    assert to_hf(VOCAB, torch.cat(ranks), DIMS)[0].flatten().tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "kind, parts", [(QKV, (Q, K, V)), (GATED, (torch.arange(4.0), torch.arange(10.0, 14)))]
)
def test_to_hf_undoes_to_megatron(kind, parts):
    whole = to_megatron(kind, reader(*parts), torch.Size([sum(len(p) for p in parts)]), Shard(), DIMS)
    assert [t.tolist() for t in to_hf(kind, whole, DIMS)] == [p.tolist() for p in parts]


@pytest.mark.parametrize(
    "name, hf",
    [
        ("decoder.layers.0.input_layernorm.weight", "model.layers.3.input_layernorm.weight"),  # local spec
        (
            "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
            "model.layers.3.input_layernorm.weight",
        ),  # TE
        (
            "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight",
            "model.layers.4.mlp.experts.3.down_proj.weight",
        ),
        (
            "decoder.layers.1.mlp.experts.linear_fc2.weight1",
            "model.layers.4.mlp.experts.3.down_proj.weight",
        ),  # grouped
    ],
)
def test_names_of_either_layer_spec_resolve_to_global_layers_and_experts(name, hf):
    from thdpack.models import qwen3_moe

    rules = active_rules(qwen3_moe.MAPPING, tied=False)
    assert match_name(name, rules, layer_offset=3, expert_offset=2).hf_names[-1] == hf
