"""GPU: Qwen3.5 (tiny dense and MoE models of tests/hf_models.py) imported with Transformer Engine: its packed
logits are transformers' per sample (fp32 on the GPU: TE's attention, Megatron's gated attention and partial RoPE,
thdpack's gated DeltaNet with flash-linear-attention's kernel where fla is installed and the torch kernels
otherwise), and bf16 training steps of the dense model make no host-device sync in steady state (the MoE
``alltoall`` dispatcher reads token counts on the host by design, README)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.hf_models import build, hf_logits_per_sample, padded_batch, save_model

from .gpu import WITH_TE, steady_step_scalars
from .training import run_in_process

pytestmark = WITH_TE

FLA = importlib.util.find_spec("fla") is not None


def _overrides(directory, *extra):
    return [
        "model=hf",
        f"model.pretrained={directory}",
        f"dataset.tokenizer={directory / 'tokenizer.json'}",
        "dataset.seq_length=256",
        "dataset.max_files=20",
        "dataset.micro_batch_size=2",
        "dataset.global_batch_size=8",
        "trainer.lr_warmup_iters=0",
        *extra,
    ]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_packed_logits_with_transformer_engine_are_transformers_on_each_sample(family, tmp_path):
    from thdpack.megatron.batch import BatchConfig, get_batch
    from thdpack.megatron.unwrap import unwrap_model

    directory = save_model(family, tmp_path / family)
    hf = build(family).cuda()
    batch = padded_batch(hf.config.vocab_size)
    with run_in_process(_overrides(directory, "trainer.precision=fp32", "trainer.train_iters=1")) as run:
        assert run.cfg.model.attention_backend == "te"
        model = unwrap_model(run.model).eval()
        with torch.no_grad():
            inputs = get_batch(iter([batch]), model.config, BatchConfig())
            logits = model(
                inputs.tokens, inputs.position_ids, None, packed_seq_params=inputs.packed_seq_params
            )
        starts = inputs.packed_seq_params.cu_seqlens_q_padded.tolist()
        on_gpu = {k: v.cuda() for k, v in batch.items()}
        worst = max(
            float((logits[0, starts[i] : starts[i] + len(ref)] - ref).abs().max())
            for i, ref in enumerate(hf_logits_per_sample(hf, on_gpu))
        )
    print(f"{family} on {torch.cuda.get_device_name()}: max |logit difference| {worst:.3g} (fla: {FLA})")
    assert worst <= 2e-3


def test_bf16_training_steps_of_qwen3_5_make_no_sync_in_steady_state(tmp_path):
    directory = save_model("qwen3_5", tmp_path / "qwen3_5")
    with run_in_process(_overrides(directory, "trainer.precision=bf16", "trainer.train_iters=6")) as run:
        settled = steady_step_scalars(run)
    assert [step for step, _, _ in settled] == [3, 4, 5, 6]
