"""trainer.precision=fp8: the TransformerConfig fields, the start-up checks, and the packer's FP8 alignment counted
per GEMM rank after context and sequence parallelism have split the packed row."""

from __future__ import annotations

import pytest
import torch

from thdpack.megatron.fp8 import check_fp8, check_fp8_attention, fp8_config
from thdpack.packing import Alignment, cp_partition_indices, pack_bshd


def test_fp8_is_hybrid_with_the_recipe_and_nothing_otherwise():
    assert fp8_config("fp8", "tensorwise") == {"fp8": "hybrid", "fp8_recipe": "tensorwise"}
    assert fp8_config("bf16", "delayed") == {}


def test_delayed_scaling_is_the_default_with_transformer_engines_amax_history_of_1024_steps_and_its_max():
    assert (
        fp8_config("fp8", "delayed")
        == fp8_config("fp8", None)
        == {
            "fp8": "hybrid",
            "fp8_recipe": "delayed",
            "fp8_amax_history_len": 1024,
            "fp8_amax_compute_algo": "max",
        }
    )


@pytest.mark.parametrize(
    ("trainer", "device", "backend", "message"),
    [
        ({"precision": "fp8"}, "cpu", "torch", "trainer.precision=fp8 needs a CUDA GPU"),
        ({"precision": "fp8"}, "cuda", "torch", "needs model.attention_backend=te"),
        ({"precision": "bf16", "fp8_recipe": "fast"}, "cuda", "te", "trainer.fp8_recipe is 'fast'"),
    ],
)
def test_an_fp8_recipe_that_cannot_run_is_refused_naming_the_key(trainer, device, backend, message):
    with pytest.raises(ValueError, match=message):
        check_fp8(trainer, device, backend)


def test_fp8_attention_on_packed_rows_is_refused_where_transformer_engine_cannot_train_it():
    fp8_attention = {"fp8_dot_product_attention": True}
    hopper, blackwell = (9, 0), (10, 0)
    # Transformer Engine 2.20.2 on an H100 left no attention backend for it, with cuDNN 9.14 and with 9.23 (measured)
    for cudnn in ((9, 14, 0), (9, 23, 0)):
        with pytest.raises(
            ValueError, match=r"model.config.fp8_dot_product_attention=true .*sm_100.*this GPU is sm_90"
        ):
            check_fp8_attention(fp8_attention, "fp8", True, hopper, cudnn)
    with pytest.raises(
        ValueError, match=r"model.config.fp8_dot_product_attention=true .* cuDNN 9.23.0 .* 9.14.0"
    ):
        check_fp8_attention(fp8_attention, "fp8", True, blackwell, (9, 14, 0))
    with pytest.raises(ValueError, match="fp8_dot_product_attention"):  # megatron-core's own fp8 key
        check_fp8_attention({**fp8_attention, "fp8": "hybrid"}, "bf16", True, hopper, (9, 23, 0))
    check_fp8_attention(fp8_attention, "fp8", True, blackwell, (9, 23, 0))
    # the rule does not apply (and the host is not asked): no FP8, padded rows (BSHD), the key not set
    check_fp8_attention(fp8_attention, "bf16", True)
    check_fp8_attention(fp8_attention, "fp8", False)
    check_fp8_attention({}, "fp8", True)
    check_fp8_attention(None, "fp8", True)


@pytest.mark.parametrize(
    ("cp", "tp", "sp"), [(1, 1, False), (2, 1, False), (1, 4, True), (2, 2, True), (4, 2, True)]
)
def test_every_gemm_rank_gets_a_multiple_of_16_tokens_after_cp_and_sp(cp, tp, sp):
    lengths = [37, 5, 120, 64, 3]
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, n in enumerate(lengths):
        rows[row, :n] = 1
    alignment = Alignment(
        cp_size=cp, tp_size=tp, sequence_parallel=sp, fp8=True, mode="fold" if cp > 1 else "distinct"
    )
    packed = pack_bshd({"tokens": rows.clone(), "attention_mask": rows}, alignment=alignment)
    for rank in range(cp):
        tokens = (
            cp_partition_indices(packed.cu_seqlens_padded, cp, rank).numel()
            if cp > 1
            else packed.total_tokens
        )
        per_gemm_rank = tokens // (tp if sp else 1)
        assert tokens % (tp if sp else 1) == 0
        assert per_gemm_rank % 16 == 0, (rank, tokens)
