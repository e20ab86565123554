"""From a Hugging Face directory through packed training to a Hugging Face directory: ``python -m thdpack.train
model=hf model.pretrained=DIR`` under torchrun (2 ranks, a Qwen3-MoE model: q/k norms, router, experts; TP2 with
sequence parallelism, the experts split over tensor parallelism, or EP2, half the experts on each rank and a
second optimizer for them), then ``python -m thdpack.export``. The export is what the
checkpoint holds, bit for bit, and transformers computes with it what thdpack computes with the checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import exported_tensors, hf_model, max_logit_difference, padded_batch, save_model

from .training import export_runs, finish, start_train, tail

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]


LAYOUTS = ["tp2", "ep2"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple]:
    """``layout -> (source HF dir, root, run, export)`` of one training run a layout (its checkpoint in
    ``root / "ckpt"``) and one export (to ``root / "out"``; None after a failed run). The runs start together,
    then the exports: independent processes."""
    roots, sources, started = {}, {}, {}
    for layout in LAYOUTS:
        roots[layout] = root = tmp_path_factory.mktemp(f"hf_e2e_{layout}")
        sources[layout] = source = save_model("qwen3_moe", root / "source")
        command = [
            "model=hf",
            f"model.pretrained={source}",
            f"dataset.tokenizer={source / 'tokenizer.json'}",
            f"parallel={layout}",
            "trainer.train_iters=2",
            "trainer.lr_warmup_iters=0",
            f"checkpoint.dir={root / 'ckpt'}",
        ]
        started[layout] = start_train(command, root / "run", nproc=2)
    runs = {layout: finish(run) for layout, run in started.items()}
    done = export_runs(runs, roots)
    return {layout: (sources[layout], roots[layout], runs[layout], done.get(layout)) for layout in LAYOUTS}


@pytest.fixture(params=LAYOUTS)
def exported(request, exports):
    """``(source HF dir, checkpoint dir, exported HF dir)`` of the layout's run; fails the test if it or its
    export failed."""
    source, root, run, export = exports[request.param]
    run.check()
    if export.returncode:
        pytest.fail(f"python -m thdpack.export exited with {export.returncode}\n{tail(export.output)}")
    return source, root / "ckpt", root / "out"


def test_the_export_is_a_directory_transformers_loads_with_its_tokenizer(exported):
    source, _, out = exported
    model = hf_model(out)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    for name in ("model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


def checkpoint_tensors(iteration_dir) -> dict[str, torch.Tensor]:
    """The model tensors of a Megatron distributed checkpoint as saved (global shapes, layers stacked on dim 0),
    read with torch.distributed.checkpoint alone."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(iteration_dir))
    meta = reader.read_metadata().state_dict_metadata
    # optimizer state: "optimizer.*", or "chained_<i>.optimizer.*" with a separate optimizer for the experts
    keys = [k for k, m in meta.items() if hasattr(m, "size") and "optimizer." not in k]
    state = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_exported_tensors_are_the_checkpoints_bit_for_bit(exported):
    source, ckpt, out = exported
    hf = exported_tensors(out)
    raw = checkpoint_tensors(ckpt / "iter_0000002")
    heads, groups, d = 4, 2, 16
    per = heads // groups
    for i in range(2):
        h, m = f"model.layers.{i}.", "decoder.layers."
        q, k, v = (hf[h + f"self_attn.{p}_proj.weight"] for p in "qkv")
        fused = torch.cat(
            [
                torch.cat(
                    [q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
                )
                for g in range(groups)
            ]
        )
        assert torch.equal(raw[m + "self_attention.linear_qkv.weight"][i], fused)
        pairs = {
            "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
            "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
            "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
            "mlp.router.weight": "mlp.gate.weight",
        }
        for megatron, name in pairs.items():
            assert torch.equal(raw[m + megatron][i], hf[h + name]), name
        for e in range(4):
            x = h + f"mlp.experts.{e}."
            gate_up = torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])
            assert torch.equal(raw[m + "mlp.experts.experts.linear_fc1.weight"][i, e], gate_up)
            assert torch.equal(
                raw[m + "mlp.experts.experts.linear_fc2.weight"][i, e], hf[x + "down_proj.weight"]
            )
    for megatron, name in [
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("output_layer.weight", "lm_head.weight"),
        ("decoder.final_layernorm.weight", "model.norm.weight"),
    ]:
        assert torch.equal(raw[megatron], hf[name]), name
    # Two Adam steps (lr at most 1e-3) moved every weight a little from the imported ones: the optimizer's main
    # parameters started from the imported weights, not from the random initialisation.
    from safetensors.torch import load_file

    imported = load_file(str(source / "model.safetensors"))
    moved = max(float((hf[n] - imported[n]).abs().max()) for n in imported)
    assert 0 < moved < 2e-3


@pytest.fixture
def one_rank_megatron(tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from thdpack.megatron import cpu

    assert not dist.is_initialized() and not ps.model_parallel_is_initialized(), "a process group leaked"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    cpu.initialize_model_parallel_cpu(seed=1234)
    yield
    cpu.destroy_model_parallel_cpu()


@pytest.mark.usefixtures("one_rank_megatron")
def test_transformers_logits_of_the_export_equal_thdpacks_of_the_checkpoint(exported):
    from thdpack.models.export import load_checkpoint_model

    _, ckpt, out = exported
    gpt = load_checkpoint_model(ckpt / "iter_0000002", ckpt / "hf").eval()
    assert max_logit_difference(gpt, hf_model(out), padded_batch(300)) <= 1e-4
