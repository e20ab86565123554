"""The command line checked before Hydra composes the recipe (thdpack.training.overrides), the value types checked
after (thdpack.training.recipe_values.check_types, thdpack.training.recipe.check_required), and how a start-up error
ends the process (thdpack.training.config_error.exit_with): one message, exit code 2, rank 0 only."""

import pytest
from hydra import compose, initialize_config_dir

from thdpack.training.config_error import ConfigError, exit_with
from thdpack.training.overrides import check_overrides
from thdpack.training.recipe import resolve_recipe
from thdpack.training.recipe_keys import recipes_dir


def refused(*argv: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_overrides(list(argv), recipes_dir())


def resolved(*overrides: str):
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        return resolve_recipe(compose("train", overrides=list(overrides)), "cpu")


@pytest.mark.parametrize("typo", ["trainer.lrr=1e-3", "+trainer.lrr=1e-3", "++trainer.lrr=1e-3"])
def test_a_misspelt_key_is_refused_with_the_closest_one_with_or_without_plus(typo):
    refused(typo, match=r"trainer\.lrr is not a recipe key: did you mean trainer\.lr\?")


def test_a_misspelt_option_is_refused_with_the_closest_one():
    refused("model=tiny_gtp", match=r"model=tiny_gtp is not a recipe option: did you mean model=tiny_gpt\?")


def test_a_misspelt_transformer_config_field_is_refused_before_hydra():
    refused("model.config.hiden_size=3", match=r"did you mean model\.config\.hidden_size\?")


def test_plus_on_a_key_the_recipe_has_asks_to_drop_the_plus():
    refused("+trainer.lr=1e-3", match=r"trainer\.lr is already in the recipe: set it without '\+'")


def test_a_key_thdpack_reads_that_the_option_lacks_asks_for_plus():
    refused("model.config.moe_router_topk=2", match=r"add it with \+model\.config\.moe_router_topk=")
    check_overrides(["+model.config.moe_router_topk=2", "+dataset.cost_weights=[1,0]"], recipes_dir())


def test_a_key_of_another_option_names_that_option():
    refused("model.freeze_vision=false", match=r"not read with model=tiny_gpt: only with model=hf$")
    refused("dataset.vlm.seed=3", match=r"only with dataset=embedded_vlm or dataset=jsonl_vlm")
    check_overrides(["model=hf", "model.freeze_vision=false"], recipes_dir())


def test_deleting_a_key_thdpack_reads_is_refused():
    refused("~trainer.lr", match=r"~trainer\.lr removes a key thdpack reads")


def test_hydra_keys_and_flags_pass_through():
    check_overrides(
        [
            "--cfg",
            "job",
            "hydra.run.dir=/tmp/x",
            "hydra/job_logging=disabled",
            "dataset=jsonl",
            "dataset.path=a",
        ],
        recipes_dir(),
    )


@pytest.mark.parametrize(("value", "quoted"), [("maybe", ""), ('"false"', r" \(unquoted\)"), ("1", "")])
def test_a_boolean_key_takes_true_or_false_only(value, quoted):
    with pytest.raises(
        ConfigError, match=rf"dataset\.pack_sequences_in_batch is .*: it must be true or false{quoted}"
    ):
        resolved(f"dataset.pack_sequences_in_batch={value}")


def test_transformer_config_fields_take_their_declared_type():
    with pytest.raises(ConfigError, match=r"model\.config\.num_layers is 2\.5: it must be an integer"):
        resolved("model.config.num_layers=2.5")
    with pytest.raises(
        ConfigError, match=r"model\.config\.add_bias_linear is 'no': it must be true or false"
    ):
        resolved("model.config.add_bias_linear=no")


def test_model_hf_without_a_directory_names_model_pretrained():
    with pytest.raises(
        ConfigError, match=r"^model=hf needs model\.pretrained=DIR, a local Hugging Face model"
    ):
        resolved("model=hf")


def test_a_start_up_error_prints_once_on_rank_0_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr("thdpack.training.config_error.RANK0_GRACE_S", 0.0)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stop:
            exit_with(ConfigError("dataset.seq_length is 0"))
        assert stop.value.code == 2
    assert capsys.readouterr().err == "thdpack: dataset.seq_length is 0\n"


def test_a_rank_specific_error_prints_on_every_rank(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit):
        exit_with(ConfigError("GPU 3 has 1 GiB free", every_rank=True))
    assert capsys.readouterr().err == "thdpack (rank 3): GPU 3 has 1 GiB free\n"
