"""Every trainable parameter is reached through its own module's call (or that module's forward pre-hooks) in a
training forward, on every family, fully fine-tuned and with LoRA, with the GPU's fused output loss.

This is what megatron-core's overlapped parameter all-gather (``trainer.overlap_param_gather``) rests on: it waits
for a module's updated parameters in that module's forward pre-hook. A parameter read without it (a fused loss
reading the untied output layer's weight, an adapter reading its ``ParameterDict``) is used with the step
before's value, and the next optimizer step stops on megatron-core's bare ``assert self.param_gather_handle is
None`` (how llama3_8b TP2 and Qwen3-30B-A3B EP4 stopped on four H200s). End to end, losses equal bit for bit with
and without the overlap: tests/functional/test_overlap.py."""

from __future__ import annotations

import pytest
import torch

from tests.lora_parity import (
    ALL,
    FAMILIES,
    ONE_RANK_TARGETS,
    SEQ,
    family_step,
    model_group,
    padded_batch,
    schedule,
    write_peft_adapter,
    write_source,
)

pytestmark = [pytest.mark.cpu_only]


def build(source, adapter, output_loss: str):
    from megatron.core import parallel_state as ps

    from tests.hf_models import parallel_sizes
    from thdpack.megatron.config import transformer_config
    from thdpack.megatron.runtime import Runtime
    from thdpack.models import get_family
    from thdpack.models.lora import apply_peft, resolve_peft

    runtime = Runtime("cpu", "fp32", "torch")
    group = {**model_group(source, ps.get_tensor_model_parallel_world_size()), "output_loss": output_loss}
    config = transformer_config(group, parallel_sizes(False), runtime)
    family = get_family(group["family"])
    module = family.build(group, config, group["vocab_size"], SEQ, runtime)
    if adapter is not None:
        module = apply_peft(
            module, resolve_peft({"name": "lora", "from_adapter": str(adapter)}, group), group, config
        )
    return module, family


def unreached(module, family, batch) -> list[str]:
    """The trainable parameters whose module's forward pre-hooks did not run in one forward and backward."""
    holders = {
        m: [n for n, p in m.named_parameters(recurse=False) if p.requires_grad] for m in module.modules()
    }
    holders = {m: names for m, names in holders.items() if names}
    reached: set[int] = set()
    handles = [m.register_forward_pre_hook(lambda m, args: reached.add(id(m))) for m in holders]
    try:
        schedule(_Wrapped(module), batch, family_step(family))
    finally:
        for h in handles:
            h.remove()
    names = {m: n for n, m in module.named_modules()}
    return sorted(f"{names[m]}.{p}" for m, ps_ in holders.items() if id(m) not in reached for p in ps_)


class _Wrapped(torch.nn.Module):
    """Just enough of megatron-core's DDP for the schedule (``zero_grad_buffer``, ``no_sync``)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = module.config

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self):
        self.module.zero_grad(set_to_none=True)

    def no_sync(self):
        import contextlib

        return contextlib.nullcontext()

    def set_input_tensor(self, tensor):
        self.module.set_input_tensor(tensor)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_trainable_parameter_is_reached_through_its_module(family, lora, tmp_path, one_rank_megatron):
    source = write_source(family, tmp_path / "source")
    adapter = (
        write_peft_adapter(source, tmp_path / "peft", ONE_RANK_TARGETS.get(family, ALL)) if lora else None
    )
    module, fam = build(source, adapter, "chunked")
    missed = unreached(module, fam, padded_batch(source))
    assert not missed, f"{family}: read without their module's forward pre-hooks: {missed}"
