"""``python -m thdpack.train model=hf ... peft=lora``, then ``python -m thdpack.export``: a LoRA run trains the
adapters only, its checkpoints hold the adapters (not the base), a run resumed from one continues to the last bit
of the uninterrupted run, and both exports (``--adapter``: PEFT's directory; without: the merged model) compute
what PEFT computes with the trained adapter. A tiny Qwen3 (q/k norms), one process."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.hf_models import hf_model, save_model
from thdpack.megatron.checkpoint import TRACKER

from .training import finish, start_train

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

ITERS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(source, reference run, its checkpoint dir, resumed run, its checkpoint dir)``: the reference trains
    ITERS steps saving every 2; the resumed run starts from a copy of its checkpoint of step 2."""
    root = tmp_path_factory.mktemp("lora_train")
    source = save_model("qwen3", root / "source")
    command = [
        "model=hf",
        f"model.pretrained={source}",
        f"dataset.tokenizer={source / 'tokenizer.json'}",
        "peft=lora",
        "peft.rank=4",
        "peft.target_modules=[q_proj,v_proj,o_proj,down_proj]",
        f"trainer.train_iters={ITERS}",
        "trainer.lr=1e-2",
        "trainer.lr_warmup_iters=0",
        "checkpoint.save_interval=2",
    ]
    reference = finish(start_train([*command, f"checkpoint.dir={root / 'ckpt'}"], root / "run")).check()
    resumed_ckpt = root / "resumed"
    resumed_ckpt.mkdir()
    shutil.copytree(root / "ckpt" / "iter_0000002", resumed_ckpt / "iter_0000002")
    shutil.copytree(root / "ckpt" / "hf", resumed_ckpt / "hf")
    (resumed_ckpt / TRACKER).write_text("2\n")
    resumed = finish(start_train([*command, f"checkpoint.dir={resumed_ckpt}"], root / "resumed_run")).check()
    return source, reference, root / "ckpt", resumed, resumed_ckpt


def test_the_run_trains_the_adapters_only(runs):
    _, reference, *_ = runs
    # rank x (in + out) of each adapted module: hidden 64, 4 heads and 2 groups of head_dim 24, MLP width 96
    per_layer = 4 * ((64 + 4 * 24) + (64 + 2 * 24) + (4 * 24 + 64) + (96 + 64))
    trainable = f"{2 * per_layer} trainable parameters"
    assert f"LoRA: rank 4, alpha 32 on q_proj, v_proj, o_proj, down_proj; {trainable}" in reference.output
    assert reference.losses[-1] < reference.losses[0]


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_not_the_base(runs):
    import torch.distributed.checkpoint as dcp

    _, _, ckpt, *_ = runs
    keys = dcp.FileSystemReader(str(ckpt / "iter_0000004")).read_metadata().state_dict_metadata
    model = sorted(k for k, m in keys.items() if hasattr(m, "size") and "optimizer." not in k)
    assert model and all(".lora_A." in k or ".lora_B." in k for k in model), model[:4]


def test_a_resumed_run_continues_as_the_uninterrupted_one_bit_for_bit(runs):
    _, reference, _, resumed, _ = runs
    assert "resumed from" in resumed.output
    logged = {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in reference.records}
    again = {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in resumed.records}
    assert [again[s] for s in (3, 4)] == [logged[s] for s in (3, 4)]


def _logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits[0]


def test_the_adapter_export_loads_in_peft_and_the_merged_export_computes_the_same(runs, tmp_path, capsys):
    from peft import PeftModel

    from thdpack.models.export import main

    source, _, ckpt, _, resumed_ckpt = runs
    main([str(ckpt), str(tmp_path / "adapter"), "--adapter"])
    main([str(ckpt), str(tmp_path / "merged")])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
        4,
        32.0,
        ["q_proj", "v_proj", "o_proj", "down_proj"],
    )
    tokens = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    peft = PeftModel.from_pretrained(hf_model(source), str(tmp_path / "adapter"))
    with_adapter, base = _logits(peft, tokens), _logits(hf_model(source), tokens)
    merged = _logits(hf_model(tmp_path / "merged"), tokens)
    assert float((with_adapter - base).abs().max()) > 1e-3  # the trained adapter changes the model
    assert float((merged - with_adapter).abs().max()) <= 1e-5 * float(with_adapter.abs().max())
    # the resumed run ended where the uninterrupted one did: the same adapter
    main([str(resumed_ckpt), str(tmp_path / "adapter_resumed"), "--adapter"])
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "adapter_resumed" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
