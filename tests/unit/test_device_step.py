"""thdpack.megatron.device_step: Megatron's optimizer step with the norm, clipping and non-finite skip on the
device, run on CPU tensors (gloo world of one) against Megatron's own step on a copy of the same model."""

from __future__ import annotations

import pytest
import torch

from thdpack.megatron.device_step import OptimizerStep

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("one_rank_megatron")]


def _model_and_optimizer(clip_grad: float = 1.0):
    """A tiny GPT in Megatron's DDP with the distributed optimizer (torch AdamW inside, on CPU), seeded."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=clip_grad, use_distributed_optimizer=True
        ),
        [ddp],
    )
    return ddp, optimizer


def _backward(ddp, scale: float = 1.0, poison: bool = False) -> None:
    ddp.zero_grad_buffer()
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    loss = ddp(tokens, positions, None, labels=tokens).sum() * scale
    loss.backward()
    ddp.finish_grad_sync()
    if poison:
        next(p for p in ddp.parameters()).main_grad.view(-1)[0] = float("nan")


def _params(ddp) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ddp.parameters()]


def _train(gate_on_device: bool, steps: list[dict], clip_grad: float = 1.0):
    ddp, optimizer = _model_and_optimizer(clip_grad)
    stepper = OptimizerStep(optimizer, "cpu", gate_on_device=gate_on_device)
    outcomes = []
    for kwargs in steps:
        _backward(ddp, **kwargs)
        outcomes.append(stepper.step())
    return ddp, optimizer, stepper, outcomes


def test_device_norm_equals_megatrons_norm():
    ddp, optimizer = _model_and_optimizer()
    _backward(ddp)
    optimizer.prepare_grads()
    expected = optimizer.get_grad_norm()
    assert OptimizerStep(optimizer, "cpu", gate_on_device=True).grad_norm().item() == pytest.approx(
        expected, rel=1e-6
    )


@pytest.mark.parametrize("scale", [1.0, 1e-4], ids=["clipped", "not_clipped"])
def test_gated_step_equals_megatrons_step(scale):
    """Up to fp32 rounding: torch's fused AdamW against torch's AdamW, the clipping coefficient in fp32 on the
    device against Megatron's in double on the host. (Over several steps Adam amplifies such rounding where a
    gradient is near zero, so one step is compared.)"""
    reference, _, _, (expected,) = _train(False, [{"scale": scale}])
    gated, _, _, (outcome,) = _train(True, [{"scale": scale}])
    assert outcome.grad_norm.item() == pytest.approx(expected.grad_norm.item(), rel=1e-6)
    assert outcome.skipped.item() == 0.0
    for got, want in zip(_params(gated), _params(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


def test_megatron_path_on_cpu_is_megatrons_optimizer_step():
    """gate_on_device=False on CPU: the numbers of ``optimizer.step()`` exactly (the CPU product path)."""
    ddp, optimizer = _model_and_optimizer()
    ours, _, _, outcomes = _train(False, [{}, {}])
    for _ in range(2):
        _backward(ddp)
        _, norm, _ = optimizer.step()
    assert outcomes[-1].grad_norm.item() == torch.tensor(norm, dtype=torch.float32).item()
    for got, want in zip(_params(ours), _params(ddp), strict=True):
        assert torch.equal(got, want)


def test_nonfinite_step_leaves_parameters_moments_and_step_count_unchanged():
    ddp, optimizer, stepper, outcomes = _train(True, [{}])
    before = _params(ddp)
    inner = optimizer.optimizer
    moments = {id(p): (s["exp_avg"].clone(), s["step"].clone()) for p, s in inner.state.items()}
    _backward(ddp, poison=True)
    outcome = stepper.step()
    assert outcome.skipped.item() == 1.0
    assert not torch.isfinite(outcome.grad_norm)
    for got, want in zip(_params(ddp), before, strict=True):
        assert torch.equal(got, want)
    for p, s in inner.state.items():
        exp_avg, step = moments[id(p)]
        assert torch.equal(s["exp_avg"], exp_avg) and torch.equal(s["step"], step)
    assert stepper.skipped_total.item() == 1.0


@pytest.mark.parametrize("gate_on_device", [True, False], ids=["gated", "megatron"])
def test_a_skipped_step_then_a_finite_one_equals_the_finite_one_alone(gate_on_device):
    reference, _, _, _ = _train(gate_on_device, [{}, {"scale": 0.5}])
    skipped, _, stepper, outcomes = _train(gate_on_device, [{}, {"poison": True}, {"scale": 0.5}])
    assert [o.skipped.item() for o in outcomes] == [0.0, 1.0, 0.0]
    for got, want in zip(_params(skipped), _params(reference), strict=True):
        assert torch.equal(got, want)


def test_forcing_the_device_path_refuses_an_optimizer_it_cannot_gate():
    ddp, optimizer = _model_and_optimizer()
    optimizer.optimizer.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="cannot be gated on the device: torch Adam with amsgrad"):
        OptimizerStep(optimizer, "cpu", gate_on_device=True)


class _TEFusedAdamLike(torch.optim.Optimizer):
    """The parts of Transformer Engine's FusedAdam the gated step uses (its class is looked up by module name):
    fp32 moments created by ``initialize_state``, the step count in each param group, ``adam_w_mode``."""

    __module__ = "transformer_engine.pytorch.optimizers.fused_adam"
    adam_w_mode, master_weights, capturable = 1, False, False

    def __init__(self, groups):
        super().__init__(
            groups,
            {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "bias_correction": True},
        )

    def initialize_state(self, param, store_param_remainders):
        self.state[param]["exp_avg"] = torch.zeros_like(param)
        self.state[param]["exp_avg_sq"] = torch.zeros_like(param)


_TEFusedAdamLike.__name__ = "FusedAdam"


class _MegatronLike:
    """A distributed optimizer's surface around one inner optimizer (its step copies nothing back)."""

    def __init__(self, inner, clip_grad=1.0):
        self.optimizer = inner
        self.config = type("Config", (), {"clip_grad": clip_grad, "use_precision_aware_optimizer": False})()
        self.grad_scaler = None

    def prepare_grads(self):
        return False

    def get_parameters(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_grads_for_grad_norm(self):
        return [p.grad for p in self.get_parameters()]

    def get_grad_stats_parallel_group(self):
        return None

    def step_with_ready_grads(self):
        self.optimizer.step()
        return True


def test_te_fused_adam_state_gets_one_device_step_count_for_all_groups_and_keeps_it_on_a_skip():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    inner = _TEFusedAdamLike([{"params": [a]}, {"params": [b], "weight_decay": 0.0}])
    stepper = OptimizerStep(_MegatronLike(inner), "cpu", gate_on_device=True)
    a.grad, b.grad = torch.full((4,), 0.1), torch.full((3,), 0.1)
    stepper.step()
    steps = [g["step"] for g in inner.param_groups]
    assert (
        steps[0] is steps[1] and steps[0].item() == 1.0
    )  # one object: megatron-core's checkpoint reads one step
    before = [a.detach().clone(), b.detach().clone(), inner.state[a]["exp_avg"].clone()]
    a.grad = torch.full((4,), float("inf"))
    assert stepper.step().skipped.item() == 1.0
    assert steps[0].item() == 1.0
    assert (
        torch.equal(a, before[0])
        and torch.equal(b, before[1])
        and torch.equal(inner.state[a]["exp_avg"], before[2])
    )


def test_a_te_step_count_loaded_from_a_checkpoint_continues_from_there():
    a = torch.nn.Parameter(torch.randn(4))
    inner = _TEFusedAdamLike([{"params": [a]}])
    stepper = OptimizerStep(_MegatronLike(inner), "cpu", gate_on_device=True)
    a.grad = torch.ones(4)
    stepper.step()
    inner.param_groups[0]["step"] = 41  # what load_state_dict leaves: the checkpoint's int
    stepper.step()
    assert inner.param_groups[0]["step"].item() == 42.0


def test_the_clip_coefficient_reaches_the_adam_kernel_as_its_gradient_scale():
    a = torch.nn.Parameter(torch.ones(4))
    inner = _TEFusedAdamLike([{"params": [a]}])
    a.grad = torch.full((4,), 10.0)  # norm 20, clip_grad 1: coefficient 1 / (20 + 1e-6)
    outcome = OptimizerStep(_MegatronLike(inner, clip_grad=1.0), "cpu", gate_on_device=True).step()
    assert outcome.grad_norm.item() == pytest.approx(20.0)
    # Adam's first moment after one step: (1 - beta1) x the clipped gradient
    torch.testing.assert_close(inner.state[a]["exp_avg"], torch.full((4,), 0.1 * 10.0 / (20.0 + 1e-6)))
