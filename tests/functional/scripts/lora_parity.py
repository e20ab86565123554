"""LoRA under model and data parallelism computes what PEFT computes.

Run by tests/functional/test_lora_parallel.py as `torchrun --nproc_per_node=2 lora_parity.py --root DIR` (DIR from
tests.lora_parity.prepare: `python -c "from pathlib import Path; from tests.lora_parity import prepare, FAMILIES;
prepare(Path('DIR'), FAMILIES)"` for `--matrix full`). For each
layout (Megatron's parallel state rebuilt in the same processes) and each of its families, every rank runs
thdpack's product path on a tiny model and a PEFT adapter made once per family (tests/lora_parity.py): the family
builds its chunk, ``peft.from_adapter`` loads the adapter's slices, ``wrap_model`` (Megatron DDP, distributed
optimizer), one packed micro-batch through Megatron's schedule, one optimizer step, ``save_checkpoint``. Checked
against PEFT on transformers' model (the same batch on every rank):
  - the loss (last pipeline stage) and every adapter gradient of this rank's layers (TP slices gathered), relative
    difference <= 1e-5;
  - on the rank holding the whole logits: the checkpoint exported as a PEFT adapter (``export_adapter``) loaded by
    ``PeftModel.from_pretrained`` gives thdpack's logits after the step, and the merged export equals PEFT's
    ``merge_and_unload`` of that adapter.
Prints one line per layout, family and rank with the measured differences.
"""

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: tests.lora_parity
warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron.core import parallel_state as ps  # noqa: E402

from tests.lora_parity import (  # noqa: E402
    exported_checks,
    grad_difference,
    padded_batch,
    peft_reference,
    thdpack_step,
)
from thdpack.megatron.cpu import initialize_model_parallel_cpu  # noqa: E402

# name: (parallel sizes, sequence parallel, the families CI checks: each family under one or two layouts)
LAYOUTS = {
    "tp2": ({"tensor_model_parallel_size": 2}, False, ["llama3", "gemma3", "qwen2_5_vl"]),
    # megatron-core trains a MoE under TP only with sequence parallelism
    "tp2sp": ({"tensor_model_parallel_size": 2}, True, ["qwen3_moe", "qwen3_5"]),
    "pp2": ({"pipeline_model_parallel_size": 2}, False, ["llama3"]),
    "cp2": ({"context_parallel_size": 2}, False, ["qwen3", "qwen3_vl"]),
    "ep2": ({"expert_model_parallel_size": 2}, False, ["qwen3_moe"]),
    "dp2": ({}, False, ["mistral", "qwen2"]),
}
TOLERANCE = 1e-5
# --matrix full: every family under every layout it runs under (the measured table of docs/lora.md)
TEXT = ["llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma3", "gpt_oss"]
EVERY = [*TEXT, "qwen2_5_vl", "qwen3_vl"]
MOE = ["qwen3_moe", "qwen3_5_moe", "gpt_oss"]
TP = [f for f in EVERY if f != "gpt_oss"]  # gpt-oss's expert biases: TP 1 only (its family refuses TP > 1)
FULL = {
    "tp2": [f for f in TP if f not in MOE],  # megatron-core trains a MoE under TP with SP only
    "tp2sp": TP,
    "pp2": [*TEXT, "qwen2_5_vl"],  # the tiny Qwen3-VL has 3 layers
    "cp2": [f for f in EVERY if not f.startswith("qwen3_5")],  # gated DeltaNet: no context parallelism
    "ep2": MOE,
    "dp2": EVERY,
}


def check(layout: str, family: str, root: Path, sequence_parallel: bool) -> None:
    source, adapter = root / family / "source", root / family / "peft"
    reference = peft_reference(source, adapter, padded_batch(source))
    ckpt = root / "runs" / layout / family / "ckpt"
    step = thdpack_step(source, adapter, ckpt, sequence_parallel=sequence_parallel)
    grads = grad_difference(step, reference)
    line = f"[{layout}] rank {dist.get_rank()} {family}: gradients {grads:.2g} ({len(step.grads)} tensors)"
    if step.loss is not None:
        loss = abs(step.loss - reference.loss) / abs(reference.loss)
        line += f", loss {loss:.2g}"
        assert loss <= TOLERANCE, f"{layout} {family}: loss {step.loss} vs PEFT {reference.loss}"
    assert grads <= TOLERANCE, f"{layout} {family}: adapter gradients differ from PEFT's by {grads}"
    reporting = (
        step.logits is not None
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
    )
    if reporting:
        exported = exported_checks(source, ckpt, ckpt.parent / "out", step.logits)
        line += f", exported logits {exported.logits:.2g}, merged {exported.merged:.2g}"
        assert exported.logits <= TOLERANCE, f"{layout} {family}: exported adapter's logits differ"
        assert exported.merged <= TOLERANCE and exported.same_tensors, (
            f"{layout} {family}: merged export differs"
        )
    print(line, flush=True)


def main(root: Path, layouts: list[str], full: bool = False) -> None:
    for layout in layouts:
        sizes, sequence_parallel, families = LAYOUTS[layout]
        families = FULL[layout] if full else families
        initialize_model_parallel_cpu(**sizes, seed=1234)
        for family in families:
            check(layout, family, root, sequence_parallel)
        dist.barrier()
        print(f"[{layout}] rank {dist.get_rank()}: all families match", flush=True)
        ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--root", type=Path, required=True, help="<family>/source and <family>/peft per family"
    )
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument(
        "--matrix", choices=("ci", "full"), default="ci", help="full: every family a layout runs"
    )
    args = parser.parse_args()
    main(args.root, args.layouts.split(","), full=args.matrix == "full")
