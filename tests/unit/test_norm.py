"""thdpack.megatron.norm: the torch layer spec's norms work under sequence parallelism, on any device."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from thdpack.megatron.models import gpt_layer_spec, torch_block_spec
from thdpack.megatron.norm import TorchNorm, build_sequence_parallel_norm


def config(**overrides) -> TransformerConfig:
    fields = {"num_layers": 1, "tensor_model_parallel_size": 2, "sequence_parallel": True, **overrides}
    return TransformerConfig(hidden_size=8, num_attention_heads=2, **fields)


def apex_present() -> bool:
    return importlib.util.find_spec("apex") is not None


@pytest.mark.parametrize(
    "normalization, cls", [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)]
)
def test_torch_norm_marks_its_weights_under_sequence_parallelism(normalization, cls):
    cfg = config(normalization=normalization)
    norm = TorchNorm(cfg, 8, eps=1e-6)
    assert type(norm) is cls and norm.eps == 1e-6
    params = list(norm.parameters())
    assert params and all(p.sequence_parallel is True for p in params)
    assert cfg.sequence_parallel  # the caller's config is not changed


def test_without_sequence_parallelism_the_build_is_untouched():
    built = []

    def build(cfg, hidden):
        built.append(cfg)
        return torch.nn.LayerNorm(hidden)

    cfg = config(sequence_parallel=False, tensor_model_parallel_size=1)
    norm = build_sequence_parallel_norm(build, cfg, 8)
    assert built == [cfg] and not hasattr(norm.weight, "sequence_parallel")


@pytest.mark.skipif(apex_present(), reason="with Apex the local spec keeps Apex's norm")
@pytest.mark.parametrize("num_experts", [None, 4])
def test_torch_layer_spec_uses_torch_norm_everywhere_megatron_would_use_wrapped_torch_norm(num_experts):
    spec = gpt_layer_spec("torch", num_experts=num_experts, qk_layernorm=True)
    attention = spec.submodules.self_attention.submodules
    assert spec.submodules.input_layernorm is TorchNorm
    assert spec.submodules.pre_mlp_layernorm is TorchNorm
    assert attention.q_layernorm is TorchNorm and attention.k_layernorm is TorchNorm


@pytest.mark.skipif(apex_present(), reason="with Apex the local spec keeps Apex's norm")
def test_torch_block_spec_builds_this_stages_layers_and_a_torch_final_norm(monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)
    layer = gpt_layer_spec("torch")
    cfg = config(num_layers=6, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    block = torch_block_spec(layer, cfg)
    assert block.layer_specs == [layer] * 3 and block.layer_norm is TorchNorm


def test_torch_norm_needs_no_cpu_support_patch():
    # A fresh process where thdpack.megatron.cpu never ran: Megatron's own WrappedTorchNorm (its layer spec's
    # norm and, without TE and Apex, its block's final norm) refuses sequence parallelism there; the torch
    # backend's norms, the final one included, build and are marked.
    code = textwrap.dedent(
        """
        import warnings; warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from thdpack.megatron.models import gpt_layer_spec, torch_block_spec
        from thdpack.megatron.norm import TorchNorm
        cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                tensor_model_parallel_size=2, sequence_parallel=True)
        try:
            WrappedTorchNorm(cfg, 8)
            print("megatron accepted")
        except AssertionError:
            print("megatron refused")
        norm = TorchNorm(cfg, 8)
        print("thdpack marked", all(p.sequence_parallel for p in norm.parameters()))
        parallel_state.get_pipeline_model_parallel_rank = lambda: 0
        block = torch_block_spec(gpt_layer_spec("torch"), cfg)
        final = build_module(block.layer_norm, config=cfg, hidden_size=8, eps=1e-5)
        print("final norm marked", all(p.sequence_parallel for p in final.parameters()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["megatron refused", "thdpack marked True", "final norm marked True"]


def test_moe_torch_spec_defines_the_routers_missing_te_gemm():
    # A fresh process without the CPU-support patch. Without Transformer Engine, Megatron's MoE router reads
    # moe_utils.te_general_gemm, which only TE defines: the torch spec with experts defines it as None. With
    # TE, moe_utils has its own and the spec leaves it alone. A dense spec never touches it.
    code = textwrap.dedent(
        """
        import warnings; warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import moe_utils
        from thdpack.megatron.models import gpt_layer_spec
        before = getattr(moe_utils, "te_general_gemm", "missing")
        gpt_layer_spec("torch")
        print("dense untouched", getattr(moe_utils, "te_general_gemm", "missing") is before)
        gpt_layer_spec("torch", num_experts=4)
        after = moe_utils.te_general_gemm
        print("moe", "None" if before == "missing" and after is None else "kept" if after is before else "changed")
        print("had", before != "missing")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    had_te_gemm = lines[2] == "had True"
    assert lines[:2] == ["dense untouched True", "moe kept" if had_te_gemm else "moe None"]
