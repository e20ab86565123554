"""thdpack.megatron.cpu: megatron-core GPT and MoE models run forward and backward on CPU (gloo world of 1)."""

import megatron.core
import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer import TransformerConfig

from thdpack.megatron import cpu

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("one_rank_megatron")]


def tiny_gpt(**overrides) -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        **{"hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides},
    )
    torch.manual_seed(0)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(num_experts=config.num_moe_experts),
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type="rope",
    )


def loss_and_grads(model: GPTModel, **forward_kwargs):
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(12).expand(2, 12)
    loss = model(tokens, position_ids, None, labels=tokens.roll(-1, 1), **forward_kwargs).mean()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_finite(loss, grads):
    assert torch.isfinite(loss)
    missing = [name for name, g in grads.items() if g is None or not torch.isfinite(g).all()]
    assert not missing, f"missing or non-finite gradients: {missing}"


def test_unknown_mcore_version_raises_with_versions_and_override(monkeypatch):
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    monkeypatch.delenv(cpu.ALLOW_UNKNOWN_MCORE_ENV, raising=False)
    with pytest.raises(RuntimeError) as error:
        cpu.enable_cpu_support()
    message = str(error.value)
    assert "found 0.99.0" in message
    assert all(v in message for v in cpu.CHECKED_MCORE_VERSIONS)
    assert f"{cpu.ALLOW_UNKNOWN_MCORE_ENV}=1" in message


def test_unknown_mcore_version_only_warns_with_override(monkeypatch):
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    monkeypatch.setenv(cpu.ALLOW_UNKNOWN_MCORE_ENV, "1")
    with pytest.warns(UserWarning, match="found 0.99.0"):
        cpu.enable_cpu_support()


def test_enable_cpu_support_is_idempotent():
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cpu.enable_cpu_support()
    before = (WrappedTorchNorm.__new__, schedules.torch)
    cpu.enable_cpu_support()
    assert (WrappedTorchNorm.__new__, schedules.torch) == before
    assert torch.cuda.current_device is not cpu._CpuCuda.current_device  # torch.cuda is never patched


def test_gpt_forward_backward_on_cpu():
    assert_finite(*loss_and_grads(tiny_gpt()))


def test_moe_gpt_forward_backward_on_cpu():
    model = tiny_gpt(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=1e-2,
        add_bias_linear=False,  # megatron-core's local experts fail with biases (mlp.py in-place add)
    )
    padding_mask = torch.zeros(2, 12, dtype=torch.bool)
    padding_mask[1, 9:] = True
    assert_finite(*loss_and_grads(model, padding_mask=padding_mask))


def test_moe_metrics_tracker_on_cpu():
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    logged = {}
    track_moe_metrics(
        loss_scale=1.0,
        iteration=1,
        writer=None,
        total_loss_dict=logged,
        num_layers=2,
        force_initialize=True,  # creates trackers for names never logged, on the "cuda" device
        track_names=["z_loss"],
    )
    assert logged["z_loss"].device.type == "cpu"


def test_rng_tracker_fork_uses_its_own_stream_and_restores_the_default():
    cpu.model_parallel_cpu_manual_seed(7)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    with get_cuda_rng_tracker().fork():
        first = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        second = torch.rand(4)
    assert torch.equal(torch.rand(4), expected)  # the default stream did not move
    assert not torch.equal(first, second)  # the forked stream did


def test_activation_recompute_replays_dropout_exactly():
    dropout = {"hidden_dropout": 0.2, "attention_dropout": 0.2}
    results = []
    for recompute in (
        {},
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    ):
        model = tiny_gpt(**dropout, **recompute)
        cpu.model_parallel_cpu_manual_seed(5)
        results.append(loss_and_grads(model))
    (loss, grads), (loss_recomputed, grads_recomputed) = results
    torch.testing.assert_close(loss_recomputed, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_recomputed[name], grad, msg=name)
