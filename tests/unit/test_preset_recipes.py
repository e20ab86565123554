"""The fine-tuning preset and the embedded SFT dataset recipe compose, and what they promise holds."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from thdpack.training.checks import check_recipe
from thdpack.training.loop import recipes_dir
from thdpack.training.recipe import resolve_recipe


def _compose(*overrides):
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_finetune_preset_is_a_small_rate_decaying_below_itself():
    trainer = _compose("trainer=finetune").trainer
    assert trainer.lr == 1e-5 and trainer.min_lr == 1e-6 and trainer.min_lr <= trainer.lr
    assert trainer.lr_decay_style == "cosine" and 0 < trainer.lr_warmup_iters < trainer.train_iters
    assert trainer.weight_decay == 0.0
    assert trainer.clip_grad == _compose().trainer.clip_grad  # the rest is trainer/default's


def test_finetune_preset_passes_the_start_up_checks():
    assert check_recipe(resolve_recipe(_compose("trainer=finetune"), "cpu"), world_size=1, device="cpu") == []


def test_embedded_sft_recipe_names_its_dataset_and_takes_the_models_tokenizer():
    dataset = _compose("dataset=embedded_sft").dataset
    assert dataset.name == "embedded_sft" and dataset.tokenizer == "auto"
    assert dataset.pack_sequences_in_batch
