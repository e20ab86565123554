"""``python -m thdpack.export`` of a vision-language checkpoint (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE): the model
imported from a tiny Hugging Face directory, saved as a training run saves it (megatron-core's
``dist_checkpointing.save`` of its ``sharded_state_dict``, the run's ``hf/`` record beside it), exported without
training: every tensor of the source directory comes back bit for bit under its own name (transformers 5.24 saves
Qwen2.5-VL as ``model.layers.*`` / ``visual.*``, Qwen3-VL(-MoE) as ``model.language_model.*`` / ``model.visual.*``;
Qwen3-VL-MoE's fused experts in the source's orientation, transformers 5.x's ``[E, 2I, H]`` or the released
checkpoints' ``[E, H, 2I]``), and transformers loads the export with no missing, unexpected or mismatched key. A
checkpoint without the frozen vision tower takes the source's; bad input is named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.hf_models import exported_tensors
from tests.vlm_models import (  # noqa: F401 - the session's model directories
    released_orientation,
    tiny_qwen3_vl,
    tiny_qwen3_vl_moe,
    tiny_vl,
)
from tests.vlm_parity import build, model_group

pytestmark = [pytest.mark.cpu_only, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

SEQ = 64
ONE_RANK = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
    expert_model_parallel_size=1,
)  # fmt: skip


def save(state: dict, ckpt, group: dict, iteration: int = 1):
    """A run's checkpoint directory: ``iter_000000<iteration>`` with the model ``state`` (a sharded state dict),
    ``hf/`` as the training loop keeps it."""
    from megatron.core import dist_checkpointing

    from thdpack.hf.directory import keep_with_checkpoint

    path = ckpt / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    dist_checkpointing.save({"model": state}, str(path))
    keep_with_checkpoint(ckpt, group, "fp32")
    return path


@pytest.fixture(
    scope="module",
    params=["tiny_vl", "tiny_qwen3_vl", "tiny_qwen3_vl_moe", "released"],
    ids=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_moe_released"],
)
def case(request, one_rank_megatron, tmp_path_factory):
    """``(source dir, model group, sharded state dict, checkpoint of it)`` for each family, no training;
    ``released``: the Qwen3-VL-MoE directory with its fused experts in the released checkpoints' orientation."""
    if request.param == "released":
        source = released_orientation(
            request.getfixturevalue("tiny_qwen3_vl_moe"), tmp_path_factory.mktemp("source") / "released"
        )
    else:
        source = request.getfixturevalue(request.param)
    group = model_group(source, SEQ)
    model, _ = build(source, group, ONE_RANK, SEQ)
    state = model.sharded_state_dict()
    return source, group, state, save(state, tmp_path_factory.mktemp("ckpt"), group)


def source_tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def bitwise_differences(a: dict, b: dict) -> list[str]:
    return [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


def test_import_then_export_gives_back_every_tensor_of_the_source_bit_for_bit(case, tmp_path):
    from thdpack.models.export import export_checkpoint

    source, _, _, iteration = case
    out = export_checkpoint(iteration, tmp_path / "out")
    exported, original = exported_tensors(out), source_tensors(source)
    assert sorted(exported) == sorted(original)
    assert bitwise_differences(original, exported) == []
    nested = any(n.startswith("model.language_model.") for n in original)
    qwen2_5 = json.loads((source / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    assert nested != qwen2_5  # the two layouts transformers 5.24 writes, both covered
    assert any(n.startswith("model.visual." if nested else "visual.") for n in exported)


def test_transformers_loads_the_export_with_no_missing_or_unexpected_key(case, tmp_path):
    from transformers import AutoModelForImageTextToText

    from thdpack.models.export import export_checkpoint

    source, _, _, iteration = case
    out = export_checkpoint(iteration, tmp_path / "out")
    model, info = AutoModelForImageTextToText.from_pretrained(str(out), output_loading_info=True)
    assert type(model).__name__ == json.loads((source / "config.json").read_text())["architectures"][0]
    assert {k: sorted(v) for k, v in info.items()} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def without_vision(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.startswith("visual.")}


def test_a_frozen_tower_absent_from_the_checkpoint_is_copied_from_the_source(case, tmp_path):
    from thdpack.models.export import export_checkpoint

    source, group, state, _ = case
    iteration = save(without_vision(state), tmp_path / "ckpt", group)
    out = export_checkpoint(iteration, tmp_path / "out")
    exported, original = exported_tensors(out), source_tensors(source)
    assert sorted(exported) == sorted(original)
    assert bitwise_differences(original, exported) == []


def test_a_frozen_tower_absent_from_the_checkpoint_and_a_gone_source_stop_the_export(case, tmp_path):
    from thdpack.models.export import export_checkpoint

    source, group, state, _ = case
    copy = tmp_path / "source"
    shutil.copytree(source, copy)
    iteration = save(without_vision(state), tmp_path / "ckpt", group | {"pretrained": str(copy)})
    shutil.rmtree(copy)
    with pytest.raises(
        FileNotFoundError, match=rf"{copy}: the run's source directory .* is gone.*frozen tower"
    ):
        export_checkpoint(iteration, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_trained_tower_absent_from_the_checkpoint_stops_the_export(case, tmp_path):
    from thdpack.models.export import export_checkpoint

    _, group, state, _ = case
    iteration = save(without_vision(state), tmp_path / "ckpt", group | {"freeze_vision": False})
    with pytest.raises(ValueError, match=r"holds no vision tower but the run trained it"):
        export_checkpoint(iteration, tmp_path / "out")


def test_a_checkpoint_tensor_the_source_did_not_have_stops_the_export_naming_it(case, tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from thdpack.models.export import export_checkpoint

    _, group, state, _ = case
    extra = ShardedTensor.from_rank_offsets("visual.extra.weight", torch.ones(3))
    iteration = save({**state, "extra": extra}, tmp_path / "ckpt", group)
    with pytest.raises(
        ValueError, match=r"did not have \(names from .*source_tensors\.json\).*visual\.extra\.weight"
    ):
        export_checkpoint(iteration, tmp_path / "out")


def test_a_source_tensor_the_checkpoint_does_not_give_stops_the_export_naming_it(case, tmp_path):
    from thdpack.models.export import export_checkpoint

    _, group, state, _ = case
    iteration = save(state, tmp_path / "ckpt", group)
    record = iteration.parent / "hf" / "source_tensors.json"
    tensors = json.loads(record.read_text())
    tensors["model.visual.extra.weight"] = {"dtype": "F32", "shape": [3]}
    record.write_text(json.dumps(tensors))
    with pytest.raises(
        ValueError, match=r"no tensor for 1 of the source directory's.*model\.visual\.extra\.weight"
    ):
        export_checkpoint(iteration, tmp_path / "out")


def test_a_chained_optimizers_state_is_not_exported(case, tmp_path):
    """An expert-parallel MoE run chains one optimizer per parameter group: its state is saved under
    ``chained_<i>.optimizer.*``, beside the model, and is no tensor of the model."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from thdpack.models.export import export_checkpoint

    source, group, state, _ = case
    key = "chained_1.optimizer.state.exp_avg.language_model.decoder.final_layernorm.weight"
    moment = ShardedTensor.from_rank_offsets(key, torch.ones(64))
    iteration = save({**state, "moment": moment}, tmp_path / "ckpt", group)
    exported = exported_tensors(export_checkpoint(iteration, tmp_path / "out"))
    assert sorted(exported) == sorted(source_tensors(source))
