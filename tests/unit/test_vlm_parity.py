"""thdpack's packed Qwen2.5-VL (Megatron GPTModel with packed MRoPE + transformers' vision tower, weights from a
Hugging Face directory) computes what transformers computes on each sample alone: the same per-token logits on a
batch of a text-only, a one-image and a two-image sample (CPU, fp32), and the same first-step loss."""

from __future__ import annotations

import pytest

from tests.vlm_models import tiny_vl  # noqa: F401 - the session's model directory
from tests.vlm_parity import (
    build,
    hf_reference,
    max_logit_difference,
    mixed_chats,
    model_group,
    samples,
    thdpack_forward,
)
from thdpack.hf.processor import VLProcessor

SEQ = 256


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from thdpack.megatron import cpu

    assert not dist.is_initialized() and not ps.model_parallel_is_initialized(), "a process group leaked"
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    cpu.initialize_model_parallel_cpu(seed=1234)
    yield
    cpu.destroy_model_parallel_cpu()


@pytest.fixture(scope="module")
def case(tiny_vl, one_rank):  # noqa: F811
    directory = tiny_vl
    batch = samples(VLProcessor(directory), mixed_chats())
    reference = hf_reference(directory, batch)
    parallel = dict(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=1,
    )  # fmt: skip
    model, _ = build(directory, model_group(directory, SEQ), parallel, SEQ)
    return batch, reference, thdpack_forward(model, batch, SEQ)


def test_the_batch_mixes_text_one_image_and_two_images_of_different_sizes(case):
    batch, _, _ = case
    grids = [s.media["image_grid_thw"].tolist() for s in batch]
    assert grids[0] == [] and len(grids[1]) == 1 and len(grids[2]) == 2 and grids[2][0] != grids[2][1]


def test_packed_logits_equal_transformers_on_each_sample_alone(case):
    batch, reference, (logits, where, _, _) = case
    assert len(where) == sum(len(s.tokens) for s in batch)  # every real token compared
    difference = max_logit_difference(reference, logits, where)
    print(f"max |logit difference| = {difference:.3g}")
    assert difference <= 1e-4


def test_first_step_loss_equals_transformers(case):
    _, reference, (_, _, loss_sum, count) = case
    assert count == reference.loss_count
    print(f"loss thdpack {loss_sum / count:.8f} transformers {reference.loss_sum / reference.loss_count:.8f}")
    assert loss_sum / count == pytest.approx(reference.loss_sum / reference.loss_count, rel=1e-5)
