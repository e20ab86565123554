"""The export of a checkpoint written by a Transformer Engine run (bf16, grouped-GEMM experts) on a CPU host,
where no TE model can be built: the checkpoint is written by megatron-core's own ``dist_checkpointing.save``
from the local-spec model's ``sharded_state_dict`` with what megatron-core 0.16.1's TE spec adds or names
otherwise (``te_sharded_state``), and the export must give back the Hugging Face tensors it was made from, bit
for bit. Tiny Qwen3-MoE of tests/hf_models.py (2 layers, 4 experts, q/k norms)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.hf_models import VOCAB, megatron_model, save_model

pytestmark = [pytest.mark.cpu_only]

LAYERS, EXPERTS = 2, 4


def te_sharded_state(gpt) -> dict:
    """What a TE-spec Qwen3-MoE run with ``moe_grouped_gemm=true`` saves (thdpack.megatron.checkpoint), built
    from ``gpt`` (local spec, one rank) and megatron-core 0.16.1's code:

    - norms: TE's MoE spec has its own ``pre_mlp_layernorm`` (gpt_layer_specs.py:265, no keys map) where the local
      spec saves ``mlp.linear_fc1.layer_norm_weight`` (its sharded_state_dict_keys_map, gpt_layer_specs.py:417);
    - experts: ``TEGroupedMLP`` stores ``experts.experts.linear_fc{1,2}.weight`` stacked (layer, expert) as
      ``SequentialMLP`` does (experts.py:768-806, TEGroupedLinear._sharded_state_dict_grouped in
      extensions/transformer_engine.py:1738), so those keys are the local model's own;
    - ``_extra_state`` ShardedObjects of every TE module, per layer (and per expert for grouped GEMM: one per
      GEMM), stored by torch_dist as bytes under ``<key>/shard_<offsets>_<shape>``: the local spec's linear
      layers have them too; TE's attention and norms add theirs;
    - the distributed optimizer's fully reshardable state (``optimizer.state.<kind>.<model key>``, fp32) and
      ``rng_state``."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    model = gpt.sharded_state_dict()
    for value in model.values():
        if value.key == "decoder.layers.mlp.linear_fc1.layer_norm_weight":
            value.key = "decoder.layers.pre_mlp_layernorm.weight"
    assert "decoder.layers.pre_mlp_layernorm.weight" in {v.key for v in model.values()}

    def extra(key, shape, offset):
        return ShardedObject(key, torch.zeros(8, dtype=torch.uint8), shape, offset, replica_id=0)

    for i in range(LAYERS):
        for module in ("core_attention", "q_layernorm", "k_layernorm"):
            key = f"decoder.layers.self_attention.{module}._extra_state"
            model[f"{key}{i}"] = extra(key, (LAYERS,), (i,))
        model[f"pre_mlp_layernorm_extra{i}"] = extra(
            "decoder.layers.pre_mlp_layernorm._extra_state", (LAYERS,), (i,)
        )
    model["decoder.final_layernorm._extra_state"] = extra("decoder.final_layernorm._extra_state", (1,), (0,))
    optimizer = {}
    for name, value in model.items():
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            fp32 = {"dtype": torch.float32} if isinstance(value, ShardedTensor) else {}
            for kind in ("exp_avg", "exp_avg_sq", "fp32_param"):
                optimizer[f"{kind}.{name}"] = replace(
                    value, key=f"optimizer.state.{kind}.{value.key}", data=value.data.float().clone(), **fp32
                )
    return {
        "model": model,
        "optimizer": optimizer,
        "rng": ShardedObject("rng_state", {"torch": torch.get_rng_state()}, (1,), (0,), replica_id=0),
        "thdpack": {"iteration": 1},
    }


@pytest.fixture(scope="module")
def te_checkpoint(one_rank_megatron, tmp_path_factory):
    """``(HF source dir, iteration dir)``: a bf16 TE-layout checkpoint of the source's weights, with the ``hf/``
    record of a TE run (attention_backend te, moe_grouped_gemm true, bf16)."""
    from megatron.core import dist_checkpointing

    from thdpack.hf.directory import keep_with_checkpoint
    from thdpack.models import pretrained_model_group

    root = tmp_path_factory.mktemp("te_ckpt")
    source = save_model("qwen3_moe", root / "source")
    gpt = megatron_model(source).to(torch.bfloat16)
    iteration = root / "ckpt" / "iter_0000001"
    iteration.mkdir(parents=True)
    dist_checkpointing.save(te_sharded_state(gpt), str(iteration))
    group = pretrained_model_group(
        {"pretrained": str(source), "attention_backend": "te", "config": {"moe_grouped_gemm": True}},
        seq_length=64,
        tp=1,
    )
    keep_with_checkpoint(root / "ckpt", group, "bf16")
    return source, iteration


def hf_bf16(source) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.to(torch.bfloat16) for k, v in load_file(str(source / "model.safetensors")).items()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_written_checkpoint_holds_what_a_te_grouped_gemm_run_writes(te_checkpoint):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    _, iteration = te_checkpoint
    meta = dcp.FileSystemReader(str(iteration)).read_metadata().state_dict_metadata
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" not in meta
    assert list(meta["decoder.layers.pre_mlp_layernorm.weight"].size) == [LAYERS, 64]
    assert list(meta["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == [
        LAYERS,
        EXPERTS,
        64,
        64,
    ]
    assert isinstance(
        meta["decoder.layers.self_attention.q_layernorm._extra_state/shard_1_2"], BytesStorageMetadata
    )
    assert "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.3_2.4" in meta
    assert "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight" in meta
    assert meta["embedding.word_embeddings.weight"].properties.dtype == torch.bfloat16


@pytest.mark.usefixtures("one_rank_megatron")
def test_megatrons_load_into_the_local_spec_misses_the_te_moe_pre_mlp_layernorm(te_checkpoint):
    """The failure on the H100 (benchmarks/results/gpu_checks_h100_2026-11-25.md): loading through the local
    spec's sharded_state_dict asks for the MoE layers' norm under the fused name."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    source, iteration = te_checkpoint
    gpt = megatron_model(source).to(torch.bfloat16)
    with pytest.raises(
        CheckpointException, match=r"decoder\.layers\.mlp\.linear_fc1\.layer_norm_weight from model not in"
    ):
        dist_checkpointing.load({"model": gpt.sharded_state_dict()}, str(iteration))


def test_the_export_of_a_te_checkpoint_is_the_hf_tensors_bit_for_bit(te_checkpoint, tmp_path):
    from safetensors.torch import load_file

    from thdpack.models.export import export_checkpoint

    source, iteration = te_checkpoint
    out = export_checkpoint(iteration, tmp_path / "out")
    exported = load_file(str(out / "model-00001-of-00001.safetensors"))
    original = hf_bf16(source)
    assert sorted(exported) == sorted(original)
    assert [n for n in original if not torch.equal(exported[n], original[n])] == []
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_model_rebuilt_from_a_te_checkpoint_holds_its_weights(te_checkpoint):
    from thdpack.hf.checkpoint_hf import hf_state
    from thdpack.models import qwen3_moe
    from thdpack.models.export import load_checkpoint_model

    source, iteration = te_checkpoint
    gpt = load_checkpoint_model(iteration, iteration.parent / "hf")
    state = hf_state(gpt, qwen3_moe.MAPPING, VOCAB)
    original = hf_bf16(source)
    assert sorted(state) == sorted(original)
    assert [n for n in original if not torch.equal(state[n], original[n])] == []


@pytest.mark.parametrize(
    ("key", "index", "name"),
    [
        ("embedding.word_embeddings.weight", (), "embedding.word_embeddings.weight"),
        ("decoder.layers.pre_mlp_layernorm.weight", (1,), "decoder.layers.1.pre_mlp_layernorm.weight"),
        (
            "decoder.layers.mlp.experts.experts.linear_fc1.weight",
            (1, 3),
            "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
        ),
        # non-homogeneous layers: one key per layer, experts still stacked
        (
            "decoder.layers.7.mlp.experts.experts.linear_fc2.weight",
            (3,),
            "decoder.layers.7.mlp.experts.local_experts.3.linear_fc2.weight",
        ),
        ("decoder.layers.7.mlp.linear_fc2.weight", (), "decoder.layers.7.mlp.linear_fc2.weight"),
    ],
)
def test_stacked_checkpoint_keys_unstack_to_the_models_names(key, index, name):
    from thdpack.hf.dist_checkpoint import unstacked_name

    assert unstacked_name(key, index) == name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_tensor_without_hf_counterpart_stops_the_export_naming_it(te_checkpoint, tmp_path):
    import shutil

    import torch.distributed.checkpoint as dcp

    _, iteration = te_checkpoint
    shutil.copytree(iteration.parent / "hf", tmp_path / "hf")
    target = tmp_path / "iter_0000001"
    state = {
        "embedding.word_embeddings.weight": torch.zeros(384, 64),
        "decoder.layers.mlp.router.expert_bias": torch.zeros(LAYERS, EXPERTS),
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target)), no_dist=True)
    (target / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    from thdpack.hf.checkpoint_hf import checkpoint_hf_tensors
    from thdpack.models import qwen3_moe

    with pytest.raises(
        ValueError, match=r"tensor 'decoder\.layers\.0\.mlp\.router\.expert_bias' has no Hugging"
    ):
        checkpoint_hf_tensors(target, tmp_path / "hf", qwen3_moe.MAPPING, VOCAB)


def test_stacked_entries_count_when_whole_are_skipped_when_absent_and_refused_when_partial():
    from types import SimpleNamespace

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk

    from thdpack.hf.dist_checkpoint import whole_entries

    # layers stacked on dim 0 of a [3, 4, 2] tensor: layer 0 in two tensor-parallel halves, layer 2 whole,
    # layer 1 absent (a layer of another kind)
    halves = [
        Chunk(torch.Size([0, 0, 0]), torch.Size([1, 2, 2])),
        Chunk(torch.Size([0, 2, 0]), torch.Size([1, 2, 2])),
    ]
    whole = Chunk(torch.Size([2, 0, 0]), torch.Size([1, 4, 2]))
    meta = SimpleNamespace(size=torch.Size([3, 4, 2]), chunks=[*halves, whole])
    assert whole_entries("k", meta, 1, "ckpt") == [(0,), (2,)]
    with pytest.raises(ValueError, match=r"ckpt: 'k' holds only part of entry \(0,\) .* 4 of 8 elements"):
        whole_entries("k", SimpleNamespace(size=meta.size, chunks=[halves[0], whole]), 1, "ckpt")
