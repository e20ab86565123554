"""The start-up checks of a recipe (thdpack.training.checks.check_recipe), one test a check, on recipes composed by Hydra
from recipes/ exactly as ``python -m thdpack.train`` composes them. Every error names the key to change.

The end-to-end test (a bad recipe stops ``python -m thdpack.train`` before any work) is in
tests/functional/test_train.py.
"""

import pytest
from hydra import compose, initialize_config_dir

from thdpack.training.checks import ConfigError, check_recipe
from thdpack.training.loop import recipes_dir
from thdpack.training.recipe import resolve_recipe


def recipe(*overrides: str):
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def check(*overrides: str, world_size: int = 1, device: str = "cpu") -> list[str]:
    return check_recipe(resolve_recipe(recipe(*overrides), device), world_size=world_size, device=device)


def fails(*overrides: str, match: str, **kwargs) -> None:
    with pytest.raises(ConfigError, match=match):
        check(*overrides, **kwargs)


@pytest.mark.parametrize(
    ("overrides", "world_size"),
    [
        ((), 1),
        (("parallel=tp2",), 2),
        (("parallel=pp2",), 4),
        (("model=tiny_moe", "parallel=ep2"), 2),
        (("model=tiny_mrope", "parallel=cp2"), 2),
        (("dataset.pack_sequences_in_batch=false", "parallel=tp2"), 2),
    ],
)
def test_shipped_layouts_pass_without_warnings(overrides, world_size):
    assert check(*overrides, world_size=world_size) == []


def test_world_size_must_be_a_multiple_of_tp_pp_cp():
    fails("parallel=tp2", match=r"world size 3 .* parallel\.tensor_model_parallel_size x", world_size=3)


def test_tp_must_divide_the_attention_heads_and_query_groups():
    # tiny_gpt: 4 heads, 2 query groups
    fails(
        "parallel.tensor_model_parallel_size=4",
        match=r"parallel\.tensor_model_parallel_size=4 must divide .*num_query_groups \(2\)",
        world_size=4,
    )


def test_expert_parallelism_needs_a_model_with_experts():
    fails(
        "parallel=ep2",
        match=r"parallel\.expert_model_parallel_size=2 needs a model with experts",
        world_size=2,
    )


def test_ep_must_divide_the_number_of_experts():
    fails(
        "model=tiny_moe",
        "parallel.expert_model_parallel_size=3",
        match=r"parallel\.expert_model_parallel_size=3 must divide model\.config\.num_moe_experts \(4\)",
        world_size=3,
    )


def test_world_size_must_be_a_multiple_of_pp_ep_tp_for_moe():
    fails(
        "model=tiny_moe",
        "parallel=ep2",
        "parallel.pipeline_model_parallel_size=3",
        match=r"world size 3 .* parallel\.pipeline_model_parallel_size x expert_model_parallel_size",
        world_size=3,
    )


def test_context_parallelism_needs_packing():
    fails(
        "model=tiny_mrope",
        "parallel=cp2",
        "dataset.pack_sequences_in_batch=false",
        match=r"parallel\.context_parallel_size=2 needs dataset\.pack_sequences_in_batch=true",
        world_size=2,
    )


def test_fold_mode_needs_causal_attention():
    fails(
        "dataset.mode=fold",
        "+model.attention_mask_type=padding",
        match=r"dataset\.mode=fold .* model\.attention_mask_type=padding",
    )


def test_attention_must_be_causal():
    fails("+model.attention_mask_type=padding", match=r"model\.attention_mask_type must be causal")


def test_sequence_parallel_without_tp_is_ignored_with_a_warning():
    assert check("parallel.sequence_parallel=true") == [
        "parallel.sequence_parallel=true with tensor_model_parallel_size=1: ignored"
    ]


@pytest.mark.parametrize(
    "bad", ["dataset.pad_to=longest", "dataset.seq_length=255"], ids=["pad_to_longest", "odd_seq_length"]
)
def test_padded_sequence_parallel_needs_full_rows_divisible_by_tp(bad):
    fails(
        "parallel=tp2",
        "dataset.pack_sequences_in_batch=false",
        bad,
        match=r"set dataset\.pad_to=seq_length and a dataset\.seq_length divisible by 2",
        world_size=2,
    )


def test_token_budget_needs_packing():
    fails(
        "dataset.pack_sequences_in_batch=false",
        "dataset.micro_batch_tokens=4096",
        match=r"dataset\.micro_batch_tokens=4096 needs dataset\.pack_sequences_in_batch=true",
    )


def test_token_bucket_must_be_a_multiple_of_the_row_alignment():
    # tp2 with sequence parallelism: the packed row's total is a multiple of 2
    fails(
        "parallel=tp2",
        "dataset.pad_total_to=4097",
        match=r"dataset\.pad_total_to=4097 must be a multiple of 2",
        world_size=2,
    )


def test_token_bucket_must_hold_a_full_micro_batch():
    # micro_batch_tokens=auto: micro_batch_size x seq_length = 4 x 1024
    fails(
        "dataset.pad_total_to=2048",
        match=r"dataset\.pad_total_to=2048 is smaller than a full micro-batch \(4096",
    )


def test_token_budget_must_hold_one_cp_aligned_sample():
    fails(
        "model=tiny_mrope",
        "parallel=cp2",
        "dataset.micro_batch_tokens=2",
        match=r"dataset\.micro_batch_tokens=2 is below .* parallel\.context_parallel_size=2 \(4 tokens\)",
        world_size=2,
    )


def test_allgather_dispatcher_under_ep_needs_a_token_bucket():
    fails(
        "model=tiny_moe",
        "parallel=ep2",
        "model.config.moe_token_dispatcher_type=allgather",
        match=r"model\.config\.moe_token_dispatcher_type=allgather .* set dataset\.pad_total_to",
        world_size=2,
    )
    check(
        "model=tiny_moe",
        "parallel=ep2",
        "model.config.moe_token_dispatcher_type=allgather",
        "dataset.pad_total_to=4096",
        world_size=2,
    )


def test_transformer_engine_attention_needs_a_gpu():
    fails("model.attention_backend=te", match=r"model\.attention_backend=te needs a CUDA GPU")


def test_transformer_engine_attention_needs_transformer_engine(monkeypatch):
    monkeypatch.setattr("thdpack.training.checks.importlib.util.find_spec", lambda name: None)
    fails(
        "model.attention_backend=te",
        match=r"model\.attention_backend=te needs Transformer Engine",
        device="cuda",
    )


def test_torch_attention_on_cuda_warns_that_rope_runs_unfused():
    (warning,) = check("model.attention_backend=torch", device="cuda")
    assert warning.startswith("attention_backend=torch on CUDA: RoPE runs unfused")


def test_warmup_must_end_before_the_decay():
    fails(
        "trainer.train_iters=2",
        match=r"trainer\.lr_warmup_iters \(2\) must be below the decay iterations \(2: trainer\.lr_decay_iters",
    )
    check("trainer.train_iters=2", "trainer.lr_decay_iters=3")


def test_on_nonfinite_is_error_or_skip():
    fails("trainer.on_nonfinite=ignore", match=r"trainer\.on_nonfinite is 'ignore': it must be error or skip")


def test_an_unknown_alignment_mode_is_named():
    fails("dataset.mode=interleaved", match=r"dataset\.mode is 'interleaved': Alignment\.mode must be one of")


def test_token_bucket_must_hold_the_fp8_alignment():
    # FP8 GEMMs need 16 tokens per rank: under TP2 + SP a row is a multiple of 32.
    fails(
        "parallel=tp2",
        "parallel.sequence_parallel=true",
        "+model.config.fp8=hybrid",
        "dataset.pad_total_to=4112",
        match=r"dataset\.pad_total_to=4112 must be a multiple of 32 .*fp8=True",
        world_size=2,
    )


def test_an_unknown_model_key_is_named_with_the_family_s_keys():
    fails("+model.rope_scaling=2", match=r"model has unknown keys \['rope_scaling'\]: the 'gpt' family reads")


def test_an_unknown_model_family_is_named():
    fails("model.family=t5", match=r"model\.family is 't5': known families are \['gpt'")
