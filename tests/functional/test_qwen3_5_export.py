"""From a Qwen3.5-MoE Hugging Face directory through packed training under TP2 (gloo, 2 ranks) to a Hugging Face
directory: ``python -m thdpack.train model=hf model.pretrained=DIR parallel=tp2``, then ``python -m thdpack.export``.
Transformers loads the export as it loads the source and computes with it what thdpack computes with the
checkpoint; the export is what the checkpoint holds bit for bit:
the gated DeltaNet and gated attention tensors, which each TP rank saved in slices, put back in transformers'
layout here by hand (per key head: queries, keys, values, z, beta, decay; per query head: query then gate)."""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import exported_tensors, save_model

from .test_hf_export import checkpoint_tensors
from .training import export_runs, finish, start_train, tail

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

KEY_HEADS, PER_KEY_HEAD, KEY_DIM, VALUE_DIM = 2, 2, 8, 12  # tests/hf_models.py's QWEN3_5
HEADS, GROUPS, HEAD_DIM = 4, 2, 16


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``(source HF dir, checkpoint dir, exported HF dir)``."""
    root = tmp_path_factory.mktemp("qwen3_5_e2e")
    source = save_model("qwen3_5_moe", root / "source")
    command = [
        "model=hf",
        f"model.pretrained={source}",
        f"dataset.tokenizer={source / 'tokenizer.json'}",
        "parallel=tp2",
        "trainer.train_iters=2",
        "trainer.lr_warmup_iters=0",
        f"checkpoint.dir={root / 'ckpt'}",
    ]
    run = finish(start_train(command, root / "run", nproc=2)).check()
    export = export_runs({"tp2": run}, {"tp2": root})["tp2"]
    if export.returncode:
        pytest.fail(f"python -m thdpack.export exited with {export.returncode}\n{tail(export.output)}")
    return source, root / "ckpt", root / "out"


def test_transformers_loads_the_export_with_every_tensor_in_place(exported):
    from transformers import AutoModelForCausalLM

    _, _, out = exported
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert {k: v for k, v in info.items() if v} == {}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_exported_tensors_are_the_checkpoints_bit_for_bit(exported):
    source, ckpt, out = exported
    hf = exported_tensors(out)
    raw = checkpoint_tensors(ckpt / "iter_0000002")
    # layer 0: gated DeltaNet, grouped by key head
    h, m = "model.layers.0.linear_attn.", "decoder.layers.0.self_attention."
    qk, v_rows = KEY_HEADS * KEY_DIM, PER_KEY_HEAD * VALUE_DIM
    qkv, z = hf[h + "in_proj_qkv.weight"], hf[h + "in_proj_z.weight"]
    b, a, conv = hf[h + "in_proj_b.weight"], hf[h + "in_proj_a.weight"], hf[h + "conv1d.weight"]
    in_proj, channels = [], []
    for j in range(KEY_HEADS):
        q_j = qkv[j * KEY_DIM : (j + 1) * KEY_DIM]
        k_j = qkv[qk + j * KEY_DIM : qk + (j + 1) * KEY_DIM]
        v_j = qkv[2 * qk + j * v_rows : 2 * qk + (j + 1) * v_rows]
        z_j, heads = z[j * v_rows : (j + 1) * v_rows], slice(j * PER_KEY_HEAD, (j + 1) * PER_KEY_HEAD)
        in_proj += [q_j, k_j, v_j, z_j, b[heads], a[heads]]
        channels += [conv[j * KEY_DIM : (j + 1) * KEY_DIM], conv[qk + j * KEY_DIM : qk + (j + 1) * KEY_DIM]]
        channels.append(conv[2 * qk + j * v_rows : 2 * qk + (j + 1) * v_rows])
    assert torch.equal(raw[m + "in_proj.weight"], torch.cat(in_proj))
    assert torch.equal(raw[m + "conv1d.weight"], torch.cat(channels))
    for megatron, name in [
        ("A_log", "A_log"),
        ("dt_bias", "dt_bias"),
        ("out_norm.weight", "norm.weight"),
        ("out_proj.weight", "out_proj.weight"),
    ]:
        assert torch.equal(raw[m + megatron], hf[h + name]), name
    # layer 1: gated full attention, per query group [queries, their gates, key, value]
    h, m = "model.layers.1.self_attn.", "decoder.layers.1.self_attention."
    q, k, v = (hf[h + f"{p}_proj.weight"] for p in "qkv")
    per, d = HEADS // GROUPS, HEAD_DIM
    fused = []
    for g in range(GROUPS):
        heads = range(g * per, (g + 1) * per)
        fused += [q[i * 2 * d : i * 2 * d + d] for i in heads] + [
            q[i * 2 * d + d : (i + 1) * 2 * d] for i in heads
        ]
        fused += [k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    assert torch.equal(raw[m + "linear_qkv.weight"], torch.cat(fused))
    assert torch.equal(raw[m + "q_layernorm.weight"], hf[h + "q_norm.weight"])
    # the shared expert and its gate
    h, m = "model.layers.1.mlp.", "decoder.layers.1.mlp.shared_experts."
    gate_up = torch.cat([hf[h + "shared_expert.gate_proj.weight"], hf[h + "shared_expert.up_proj.weight"]])
    assert torch.equal(raw[m + "linear_fc1.weight"], gate_up)
    assert torch.equal(raw[m + "gate_weight"], hf[h + "shared_expert_gate.weight"])
    # two Adam steps moved the imported weights a little: training started from them
    from safetensors.torch import load_file

    imported = load_file(str(source / "model.safetensors"))
    moved = max(float((hf[n] - imported[n]).abs().max()) for n in imported)
    assert 0 < moved < 1e-2


@pytest.mark.usefixtures("one_rank_megatron")
def test_transformers_logits_of_the_export_equal_thdpacks_of_the_checkpoint(exported):
    from tests.hf_models import hf_model, max_logit_difference, padded_batch
    from thdpack.models.export import load_checkpoint_model

    _, ckpt, out = exported
    model = load_checkpoint_model(ckpt / "iter_0000002", ckpt / "hf").eval()
    assert max_logit_difference(model, hf_model(out), padded_batch(300)) <= 1e-5
