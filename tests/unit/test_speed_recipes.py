"""The recipe keys of issue 24's memory and precision settings, through resolve_recipe and check_recipe as
``python -m thdpack.train`` runs them (trainer.precision=fp8, the precision-aware optimizer,
dataset.micro_batch_tokens=fit): each refusal names its key."""

import pytest
from hydra import compose, initialize_config_dir

from thdpack.megatron.config import transformer_config
from thdpack.megatron.runtime import Runtime
from thdpack.training.checks import ConfigError, check_recipe
from thdpack.training.loop import recipes_dir
from thdpack.training.recipe import resolve_recipe


def recipe(*overrides: str):
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def check(*overrides: str, device: str = "cpu") -> list[str]:
    return check_recipe(resolve_recipe(recipe(*overrides), device), world_size=1, device=device)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("trainer.precision=fp8",), "trainer.precision=fp8 needs a CUDA GPU"),
        (
            ("trainer.use_precision_aware_optimizer=true",),
            "use_precision_aware_optimizer=true needs a CUDA GPU",
        ),
        (
            ("trainer.exp_avg_dtype=bf16",),
            "exp_avg_dtype=bf16 needs trainer.use_precision_aware_optimizer=true",
        ),
        (("trainer.fp8_recipe=fast",), "trainer.fp8_recipe is 'fast'"),
        (("dataset.micro_batch_tokens=fit",), "micro_batch_tokens=fit sizes the budget to a GPU's memory"),
    ],
)
def test_a_setting_this_device_cannot_run_is_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        check(*overrides)


def test_fp8_precision_gives_bf16_weights_and_te_fp8_in_the_transformer_config():
    cfg = recipe("trainer.precision=fp8", "trainer.fp8_recipe=delayed")
    config = transformer_config(cfg.model, cfg.parallel, Runtime("cuda", "fp8", "torch", "delayed"))
    assert (config.bf16, config.fp8, config.fp8_recipe) == (True, "hybrid", "delayed")
    assert (config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (1024, "max")


def test_the_default_fp8_recipe_is_delayed_and_model_config_amax_keys_win():
    cfg = recipe("trainer.precision=fp8", "++model.config.fp8_amax_history_len=16")
    config = transformer_config(
        cfg.model, cfg.parallel, Runtime("cuda", "fp8", "torch", cfg.trainer.fp8_recipe)
    )
    assert (config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (
        "delayed",
        16,
        "max",
    )


def test_an_fp8_models_config_rebuilt_on_cpu_has_no_fp8():
    cfg = recipe()
    config = transformer_config(cfg.model, cfg.parallel, Runtime("cpu", "fp8", "torch", "delayed"))
    assert config.fp8 is None and config.bf16
