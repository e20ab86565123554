"""LoRA (``peft=lora``) computes what PEFT computes, on every family (fp32, CPU, one rank): the same tiny model and
the same adapter (PEFT's own, random A and B, loaded through ``peft.from_adapter``) give the first step's loss and
every adapter gradient of PEFT's; after thdpack's optimizer step and checkpoint, the exported adapter loads in
``PeftModel.from_pretrained`` and gives thdpack's logits, and the merged export equals PEFT's ``merge_and_unload``.
The same checks under TP, SP, PP, CP, EP and DP: tests/functional/test_lora_parallel.py. Helpers:
tests/lora_parity.py."""

from __future__ import annotations

import pytest

from tests.lora_parity import (
    ALL,
    FAMILIES,
    ONE_RANK_TARGETS,
    Exported,
    exported_checks,
    grad_difference,
    padded_batch,
    peft_reference,
    thdpack_step,
    write_peft_adapter,
    write_source,
)

pytestmark = [pytest.mark.cpu_only]

TOLERANCE = 1e-5  # relative, fp32


@pytest.fixture(scope="module", params=FAMILIES)
def measured(request, tmp_path_factory, one_rank_megatron):
    """``(family, loss difference, largest gradient difference, Exported)``, relative."""
    family = request.param
    root = tmp_path_factory.mktemp(f"lora_{family}")
    source = write_source(family, root / "source")
    adapter = write_peft_adapter(source, root / "peft", ONE_RANK_TARGETS.get(family, ALL))
    reference = peft_reference(source, adapter, padded_batch(source))
    step = thdpack_step(source, adapter, root / "ckpt")
    exported = exported_checks(source, root / "ckpt", root / "out", step.logits)
    loss = abs(step.loss - reference.loss) / abs(reference.loss)
    print(
        f"{family}: loss {loss:.2g}, gradients {grad_difference(step, reference):.2g}, exported logits "
        f"{exported.logits:.2g}, merged {exported.merged:.2g}"
    )
    return family, loss, grad_difference(step, reference), exported


def test_first_step_loss_equals_peft(measured):
    assert measured[1] <= TOLERANCE


def test_every_adapter_gradient_equals_peft(measured):
    assert measured[2] <= TOLERANCE


def test_the_exported_adapter_loaded_by_peft_gives_thdpacks_logits(measured):
    exported: Exported = measured[3]
    assert exported.logits <= TOLERANCE


def test_the_merged_export_equals_peft_merge_and_unload_with_the_base_tensor_names(measured):
    exported: Exported = measured[3]
    assert exported.merged <= TOLERANCE
    assert exported.same_tensors
