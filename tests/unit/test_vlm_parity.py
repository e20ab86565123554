"""thdpack's packed Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (Megatron GPTModel with packed MRoPE + transformers'
vision tower; Qwen3-VL: interleaved MRoPE sections, q/k norms, DeepStack features added after the first decoder
layers; Qwen3-VL-MoE: the same with Megatron's MoE layers, experts read from the fused tensors; weights
from a Hugging Face directory) compute what transformers computes on each sample alone: the same per-token logits
on a batch of a text-only, a one-image and a two-image sample (CPU, fp32), and the same first-step loss."""

from __future__ import annotations

import pytest

from tests.vlm_models import tiny_qwen3_vl, tiny_qwen3_vl_moe, tiny_vl  # noqa: F401 - the session's model directories
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


@pytest.fixture(
    scope="module",
    params=["tiny_vl", "tiny_qwen3_vl", "tiny_qwen3_vl_moe"],
    ids=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"],
)
def case(request, one_rank_megatron):
    directory = request.getfixturevalue(request.param)
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


@pytest.fixture(scope="module")
def qwen3_inputs(tiny_qwen3_vl, one_rank_megatron):  # noqa: F811
    batch = samples(VLProcessor(tiny_qwen3_vl), mixed_chats())
    return tiny_qwen3_vl, batch, hf_reference(tiny_qwen3_vl, batch)


@pytest.mark.parametrize("ablation", ["no_deepstack", "contiguous_mrope"])
def test_qwen3_vl_parity_fails_without_deepstack_or_interleaved_mrope(qwen3_inputs, ablation, monkeypatch):
    """The parity check above can fail: dropping the DeepStack features, or rotating with Qwen2.5-VL's contiguous
    MRoPE sections, moves the image samples' logits far past 1e-4 (measured 3.6 and 0.25)."""
    import thdpack.megatron.deepstack as deepstack
    import thdpack.megatron.vlm as vlm

    if ablation == "no_deepstack":
        addend = deepstack.deepstack_addend
        monkeypatch.setattr(deepstack, "deepstack_addend", lambda *args: addend(*args) * 0)
    else:
        build_language_model = vlm.build_language_model

        def contiguous(*args, mrope_interleaved, **kwargs):
            return build_language_model(*args, mrope_interleaved=False, **kwargs)

        monkeypatch.setattr(vlm, "build_language_model", contiguous)
    directory, batch, reference = qwen3_inputs
    parallel = dict(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=1,
    )  # fmt: skip
    model, _ = build(directory, model_group(directory, SEQ), parallel, SEQ)
    logits, where, _, _ = thdpack_forward(model, batch, SEQ)
    assert max_logit_difference(reference, logits, where) > 1e-2
