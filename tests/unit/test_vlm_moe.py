"""Qwen3-VL-MoE's own pieces (the packed logits and loss against transformers are tests/unit/test_vlm_parity.py's):
every token goes to the experts transformers picks, in every layer; the fused experts read the same in both
orientations found in the wild; what Megatron cannot reproduce is refused, naming the key."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from tests.vlm_models import released_orientation, tiny_qwen3_vl_moe  # noqa: F401 - the session's model directory
from tests.vlm_parity import _owners, build, mixed_chats, model_group, samples, thdpack_forward
from thdpack.hf.checkpoint import HFConfigError
from thdpack.hf.processor import VLProcessor

SEQ = 256
PARALLEL = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
    expert_model_parallel_size=1,
)  # fmt: skip


def hf_routing(directory, batch):
    """transformers on each sample alone: per sample, per layer, the router logits ``[L, E]`` and the chosen
    experts ``[L, k]``."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32).eval()
    routers = [layer.mlp.gate for layer in model.model.language_model.layers]
    takes_types = "mm_token_type_ids" in inspect.signature(model.model.forward).parameters
    out = []
    for s in batch:
        seen = []
        hooks = [
            r.register_forward_hook(lambda m, a, o, seen=seen: seen.append((o[0], o[2]))) for r in routers
        ]
        kwargs = {}
        if len(s.media["image_grid_thw"]):
            kwargs = dict(
                pixel_values=torch.from_numpy(s.media["pixel_values"]),
                image_grid_thw=torch.from_numpy(s.media["image_grid_thw"]),
            )
            if takes_types:
                kwargs["mm_token_type_ids"] = torch.from_numpy(s.mm_token_type_ids.astype("int64"))[None]
        with torch.no_grad():
            model(input_ids=torch.from_numpy(s.tokens)[None], use_cache=False, **kwargs)
        for h in hooks:
            h.remove()
        out.append(seen)
    return out


def test_every_token_goes_to_the_experts_transformers_picks_in_every_layer(
    tiny_qwen3_vl_moe,  # noqa: F811
    one_rank_megatron,
):
    """Routing is exact, not only close: the logits agree to ~1e-6 and, with these weights (seed 0, std 0.1), the
    k-th and (k+1)-th router logits of every token differ by far more (the margin printed), so no near-tie can
    flip a choice between the two implementations' rounding. (A tie within rounding would be a coin toss in
    either implementation; fp32 router logits of random weights rarely come that close.)"""
    from thdpack import Alignment, pack_bshd
    from thdpack.data.collate import collate

    batch = samples(VLProcessor(tiny_qwen3_vl_moe), mixed_chats())
    reference = hf_routing(tiny_qwen3_vl_moe, batch)
    model, config = build(tiny_qwen3_vl_moe, model_group(tiny_qwen3_vl_moe, SEQ), PARALLEL, SEQ)
    routed = []
    routers = [layer.mlp.router for layer in model.language_model.decoder.layers]
    hooks = [r.register_forward_hook(lambda m, a, o: routed.append(o[1])) for r in routers]
    thdpack_forward(model, batch, SEQ)
    for h in hooks:
        h.remove()
    collated = collate(batch, SEQ, pad_id=0, pad_to="longest")
    for key in ("pixel_values", "image_grid_thw"):
        collated.pop(key)
    owner = _owners(pack_bshd(collated, alignment=Alignment(mode="distinct")))
    k, layers = config.moe_router_topk, config.num_layers
    margin, compared = float("inf"), 0
    for layer in range(layers):
        chosen = routed[layer]  # the first forward's routing map [T, E] of this layer
        for position, (row, col) in owner.items():
            logits, experts = reference[row][layer]
            assert set(chosen[position].nonzero().flatten().tolist()) == set(experts[col].tolist()), (
                f"layer {layer}, sample {row}, token {col}"
            )
            top = logits[col].sort(descending=True).values
            margin = min(margin, float(top[k - 1] - top[k]))
            compared += 1
    print(f"{compared} routing decisions equal; smallest top-{k} logit margin {margin:.3g}")
    assert compared == layers * sum(len(s.tokens) for s in batch)
    assert margin > 1e-4


def fused_reader(directory):
    from thdpack.hf.checkpoint import SafetensorsReader
    from thdpack.hf.fused_experts import FusedExpertsReader
    from thdpack.hf.vl_checkpoint import LanguageModelReader

    return FusedExpertsReader(LanguageModelReader(SafetensorsReader(directory)), 4, 64, 48)


def test_both_fused_expert_orientations_read_as_the_same_per_expert_weights(tiny_qwen3_vl_moe, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    saved, released = (
        fused_reader(tiny_qwen3_vl_moe),
        fused_reader(released_orientation(tiny_qwen3_vl_moe, tmp_path / "released")),
    )
    assert saved.names() == released.names()
    fused = load_file(tiny_qwen3_vl_moe / "model.safetensors")
    gate_up = fused[
        "model.language_model.layers.1.mlp.experts.gate_up_proj"
    ]  # [E, 2I, H], nn.Linear's out x in
    down = fused["model.language_model.layers.1.mlp.experts.down_proj"]
    expected = {"gate_proj": gate_up[2, :48], "up_proj": gate_up[2, 48:], "down_proj": down[2]}
    for part, value in expected.items():
        name = f"model.layers.1.mlp.experts.2.{part}.weight"
        assert saved.shape(name) == released.shape(name) == tuple(value.shape)
        assert torch.equal(saved.read(name), value) and torch.equal(released.read(name), value)
        # a slice, as an expert-tensor-parallel rank reads it: rows of gate/up, columns of down
        rows, cols = (slice(None), slice(24, 48)) if part == "down_proj" else (slice(24, 48), slice(None))
        assert torch.equal(released.read(name, rows, cols), value[rows, cols])
    assert "model.layers.1.mlp.experts.gate_up_proj" not in saved.names()


def test_fused_experts_of_another_shape_are_refused_naming_the_layer_and_both_orientations(
    tiny_qwen3_vl_moe,  # noqa: F811
):
    from thdpack.hf.checkpoint import SafetensorsReader
    from thdpack.hf.fused_experts import FusedExpertsReader
    from thdpack.hf.vl_checkpoint import LanguageModelReader

    with pytest.raises(
        ValueError, match=r"layer 0's fused experts .* needs \[4, 64, 64\] .* or \[4, 64, 64\]"
    ):
        FusedExpertsReader(LanguageModelReader(SafetensorsReader(tiny_qwen3_vl_moe)), 4, 64, 32)


@pytest.mark.parametrize("orientation", ["transformers_5", "released"])
def test_the_per_expert_weights_read_fuse_back_into_the_source_tensors_bit_for_bit(
    tiny_qwen3_vl_moe,  # noqa: F811
    tmp_path,
    orientation,
):
    """Import and export are inverses: the reader's per-expert tensors, fused in the orientation of the source's
    shapes, are the source's fused tensors (names, shapes, bits)."""
    from safetensors.torch import load_file

    from thdpack.hf.fused_experts import fuse_experts

    directory = tiny_qwen3_vl_moe
    if orientation == "released":
        directory = released_orientation(tiny_qwen3_vl_moe, tmp_path / "released")
    reader, source = fused_reader(directory), load_file(directory / "model.safetensors")
    experts = {n: reader.read(n) for n in reader.names() if ".mlp.experts." in n}
    assert len(experts) == 3 * 4 * 3  # layers x experts x (gate, up, down)
    shapes = {n.replace("model.language_model.", "model."): list(t.shape) for n, t in source.items()}
    fused = fuse_experts(experts, shapes, 4, 64, 48, "checkpoint", "source")
    assert sorted(fused) == sorted(
        n for n in shapes if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    )
    for name, tensor in fused.items():
        original = source[name.replace("model.", "model.language_model.", 1)]
        assert tensor.dtype == original.dtype and torch.equal(tensor, original), name


def hand_written_experts(experts=2, hidden=4, intermediate=3, prefix="model.language_model."):
    """Per-expert tensors of one layer, every weight distinct: ``(tensors, source shapes out x in)``."""
    tensors, values = {}, iter(range(10**6))
    for e in range(experts):
        for part, shape in (("gate", (intermediate, hidden)), ("up", (intermediate, hidden)),
                            ("down", (hidden, intermediate))):  # fmt: skip
            n = shape[0] * shape[1]
            weight = torch.tensor([float(next(values)) for _ in range(n)]).reshape(shape)
            tensors[f"{prefix}layers.0.mlp.experts.{e}.{part}_proj.weight"] = weight
    shapes = {
        f"{prefix}layers.0.mlp.experts.gate_up_proj": [experts, 2 * intermediate, hidden],
        f"{prefix}layers.0.mlp.experts.down_proj": [experts, hidden, intermediate],
    }
    return tensors, shapes


def test_fusing_stacks_gate_then_up_per_expert_in_the_sources_orientation():
    from thdpack.hf.fused_experts import fuse_experts

    tensors, shapes = hand_written_experts()
    p = "model.language_model.layers.0.mlp.experts."
    fused = fuse_experts(tensors, shapes, 2, 4, 3, "ckpt", "source")
    assert fused[p + "gate_up_proj"].shape == (2, 6, 4) and fused[p + "down_proj"].shape == (2, 4, 3)
    assert torch.equal(fused[p + "gate_up_proj"][1, :3], tensors[p + "1.gate_proj.weight"])
    assert torch.equal(fused[p + "gate_up_proj"][1, 3:], tensors[p + "1.up_proj.weight"])
    assert torch.equal(fused[p + "down_proj"][0], tensors[p + "0.down_proj.weight"])
    released = {p + "gate_up_proj": [2, 4, 6], p + "down_proj": [2, 3, 4]}
    transposed = fuse_experts(tensors, released, 2, 4, 3, "ckpt", "source")
    assert torch.equal(transposed[p + "gate_up_proj"], fused[p + "gate_up_proj"].transpose(1, 2))
    assert torch.equal(transposed[p + "down_proj"], fused[p + "down_proj"].transpose(1, 2))
    assert transposed[p + "gate_up_proj"].is_contiguous()


def test_an_expert_missing_from_the_checkpoint_stops_the_fusing_naming_it():
    from thdpack.hf.fused_experts import fuse_experts

    tensors, shapes = hand_written_experts()
    del tensors["model.language_model.layers.0.mlp.experts.1.up_proj.weight"]
    with pytest.raises(
        ValueError,
        match=r"ckpt: the checkpoint gives no \['model\.language_model\.layers\.0\.mlp\.experts\.1\.up_proj"
        r"\.weight'\].*all 2 experts \(num_experts\)",
    ):
        fuse_experts(tensors, shapes, 2, 4, 3, "ckpt", "source")


def test_source_shapes_of_neither_orientation_stop_the_fusing_naming_the_tensor_and_both_rules():
    from thdpack.hf.fused_experts import fuse_experts

    tensors, shapes = hand_written_experts()
    p = "model.language_model.layers.0.mlp.experts."
    shapes[p + "down_proj"] = [2, 3, 4]  # gate_up out x in, down in x out: no orientation fits the pair
    with pytest.raises(
        ValueError,
        match=r"source \('model\.language_model\.layers\.0\.mlp\.experts\.gate_up_proj'\): layer 0's fused "
        r"experts are gate_up_proj \[2, 6, 4\] and down_proj \[2, 3, 4\].*needs \[2, 6, 4\] and \[2, 4, 3\] "
        r"\(transformers 5\.x\) or \[2, 4, 6\] and \[2, 3, 4\] \(the released checkpoints\)",
    ):
        fuse_experts(tensors, shapes, 2, 4, 3, "ckpt", "source")
    del shapes[p + "down_proj"]
    with pytest.raises(ValueError, match=r"source: the source directory has no \['model.*down_proj'\]"):
        fuse_experts(tensors, shapes, 2, 4, 3, "ckpt", "source")


def test_the_model_group_is_the_qwen3_moe_group_with_mrope_and_its_family(tiny_qwen3_vl_moe):  # noqa: F811
    from thdpack.models import get_family, pretrained_model_group

    group = pretrained_model_group({"pretrained": str(tiny_qwen3_vl_moe)}, seq_length=SEQ, tp=1)
    config = group["config"]
    assert group["name"] == "hf_qwen3_vl_moe" and group["position_embedding_type"] == "mrope"
    assert (config["num_moe_experts"], config["moe_router_topk"], config["moe_ffn_hidden_size"]) == (4, 2, 48)
    assert (
        config["moe_router_pre_softmax"] is False
    )  # top-k renormalised, as transformers' router always does
    assert config["mrope_section"] == [6, 5, 5]
    assert get_family(group["family"]).name == "qwen3_vl_moe"


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"norm_topk_prob": False},
            r"norm_topk_prob is False: transformers' Qwen3-VL-MoE router renormalises",
        ),
        (
            {"mlp_only_layers": [1]},
            r"key 'mlp_only_layers' is \[1\]: thdpack needs \[\] \(every layer is a mixture",
        ),
        (
            {"decoder_sparse_step": 2},
            r"key 'decoder_sparse_step' is 2: thdpack needs 1 \(every layer is a mixture",
        ),
    ],
    ids=["norm_topk_prob_false", "mlp_only_layers", "decoder_sparse_step"],
)
def test_what_megatron_cannot_reproduce_is_refused_naming_the_key(
    tiny_qwen3_vl_moe,  # noqa: F811
    tmp_path,
    edit,
    message,
):
    from thdpack.models import pretrained_model_group

    config = json.loads((tiny_qwen3_vl_moe / "config.json").read_text())
    config["text_config"].update(edit)
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    with pytest.raises(HFConfigError, match=message):
        pretrained_model_group({"pretrained": str(tmp_path)}, seq_length=SEQ, tp=1)


def test_the_released_qwen3_vl_30b_a3b_config_maps_to_megatrons_moe():
    """Qwen/Qwen3-VL-30B-A3B-Instruct's config.json as released (transformers 4.57's keys: rope_scaling beside
    rope_theta, num_experts, norm_topk_prob)."""
    from thdpack.hf.checkpoint import HFCheckpoint
    from thdpack.models import model_group

    text = dict(
        attention_bias=False, attention_dropout=0.0, bos_token_id=151643, decoder_sparse_step=1, dtype="bfloat16",
        eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=2048, initializer_range=0.02,
        intermediate_size=6144, max_position_embeddings=262144, mlp_only_layers=[], model_type="qwen3_vl_moe_text",
        moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-06,
        rope_scaling=dict(mrope_interleaved=True, mrope_section=[24, 20, 20], rope_type="default"),
        rope_theta=5000000, use_cache=True, vocab_size=151936,
    )  # fmt: skip
    vision = dict(
        deepstack_visual_indexes=[8, 16, 24], depth=27, hidden_act="gelu_pytorch_tanh", hidden_size=1152,
        in_channels=3, initializer_range=0.02, intermediate_size=4304, model_type="qwen3_vl_moe", num_heads=16,
        num_position_embeddings=2304, out_hidden_size=2048, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2,
    )  # fmt: skip
    config = dict(
        architectures=["Qwen3VLMoeForConditionalGeneration"], image_token_id=151655, model_type="qwen3_vl_moe",
        text_config=text, tie_word_embeddings=False, transformers_version="4.57.0.dev0", video_token_id=151656,
        vision_config=vision, vision_end_token_id=151653, vision_start_token_id=151652,
    )  # fmt: skip
    group = model_group(HFCheckpoint.from_config(config), seq_length=4096, tp=2)
    moe = {k: group["config"][k] for k in ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size")}
    assert moe == {"num_moe_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 768}
    assert group["config"]["mrope_section"] == [24, 20, 20] and group["rotary_base"] == 5000000.0
    assert group["config"]["moe_router_pre_softmax"] is False and group["vocab_size"] == 151936
