"""Load a Hugging Face checkpoint's tensors into this rank's Megatron-core ``GPTModel`` chunk by a family's mapping.

    loaded = load_weights(gpt, checkpoint.tensors(), family.mapping, vocab)   # thdpack.models.decoder
    set_rotary_frequencies(gpt, group["rotary_base"], group["rope_scaling"])
    never_predict_padding(gpt, vocab)

Each rank opens the safetensors files memory-mapped (``safe_open``) and reads only the rows and columns it holds
(``get_slice``): its pipeline stage's layers, its experts, its tensor-parallel slice. No rank materialises the
whole model. Beside the weights it sets what the weights alone do not carry: RoPE's inverse frequencies from the
checkpoint's ``rope_theta`` and Llama 3 scaling, and, where Megatron pads the vocabulary (tensor parallelism not
dividing it), logits of ``-inf`` on the padded rows, so that no softmax (the loss's or anyone's reading the
logits) ever gives them probability. The mask sits on the output layer's forward: a loss that computes the
logits without calling it (a fused output-layer cross entropy) must mask those rows itself.

A checkpoint tensor the model has no place for, a model tensor the checkpoint lacks, or a shape that does not fit
stops the load, naming the key, the file and the rule. Checked against transformers 5.24.0 (CPU) and 5.17 (GPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .mapping import (
    VOCAB,
    Dims,
    Rule,
    Shard,
    active_rules,
    expected_hf_names,
    hf_shapes,
    layer_types,
    match_name,
    to_megatron,
)

__all__ = [
    "inverse_frequencies",
    "load_weights",
    "never_predict_padding",
    "set_rotary_frequencies",
    "use_inverse_frequencies",
]


def _parallel() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
        "etp_size": ps.get_expert_tensor_parallel_world_size(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "ep_size": ps.get_expert_model_parallel_world_size(),
    }


def load_weights(gpt, reader, mapping: Iterable[Rule], vocab: int) -> int:
    """Copy this rank's slice of every checkpoint tensor into ``gpt`` (a bare ``GPTModel`` chunk) by the family's
    ``mapping``; ``reader``: the checkpoint's tensors (``names``, ``shape``, ``read(name, rows, cols)``,
    ``where``: :class:`~thdpack.hf.checkpoint.SafetensorsReader`); ``vocab``: config.json's ``vocab_size``.
    Returns the number of tensors loaded."""
    config = gpt.config
    tied = bool(gpt.share_embeddings_and_output_weights)
    rules = active_rules(mapping, tied)
    experts = config.num_moe_experts or 0
    expected = expected_hf_names(rules, config.num_layers, experts, layer_types(config))
    present = reader.names()
    # a tied checkpoint that keeps lm_head anyway: accepted where it equals the embedding (checked below)
    extra_head = tied and "lm_head.weight" in present
    missing = sorted(expected - present)
    unexpected = sorted(present - expected - ({"lm_head.weight"} if extra_head else set()))
    if missing or unexpected:
        raise ValueError(
            f"{reader.directory}: the checkpoint does not fit the model its config.json describes"
            + (f"; missing {len(missing)} tensors: {missing[:8]}" if missing else "")
            + (
                f"; {len(unexpected)} tensors the model has no place for: {unexpected[:8]}"
                if unexpected
                else ""
            )
        )
    par = _parallel()
    dims = Dims.of(config, vocab)
    layer_offset = gpt.decoder.layers[0].layer_number - 1 if len(gpt.decoder.layers) else 0
    expert_offset = par["ep_rank"] * (experts // par["ep_size"]) if experts else 0
    loaded = 0
    with torch.no_grad():
        for name, target in gpt.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state") or target is None:
                continue
            m = match_name(name, rules, layer_offset, expert_offset)
            if m is None:
                raise ValueError(
                    f"the model's tensor '{name}' has no Hugging Face counterpart (the family's mapping): "
                    "a model setting beyond what config.json describes?"
                )
            shard = (
                Shard(par["etp_rank"], par["etp_size"])
                if m.rule.per_expert
                else Shard(par["tp_rank"], par["tp_size"])
            )
            if m.rule.kind == VOCAB:
                shard = Shard(par["tp_rank"], par["tp_size"])
            names = m.hf_names
            for hf_name, want in zip(names, hf_shapes(m.rule.kind, target.shape, shard, dims), strict=True):
                got = reader.shape(hf_name)
                if got != want:
                    raise ValueError(
                        f"{reader.where(hf_name)}: '{hf_name}' is {list(got)} but '{name}' of the model built from "
                        f"config.json needs {list(want)} ({m.rule.kind} tensor, {shard.size}-way split)"
                    )

            def read(i, rows, cols, names=names):
                return reader.read(names[i], rows, cols)

            value = to_megatron(m.rule.kind, read, target.shape, shard, dims)
            if extra_head and m.rule.kind == VOCAB:
                head = to_megatron(
                    VOCAB, lambda i, r, c: reader.read("lm_head.weight", r, c), target.shape, shard, dims
                )
                if not torch.equal(head, value):
                    raise ValueError(
                        f"{reader.where('lm_head.weight')}: tie_word_embeddings is true but 'lm_head.weight' differs "
                        "from 'model.embed_tokens.weight': which one should the model use?"
                    )
            target.copy_(value)
            loaded += 1
    return loaded


def inverse_frequencies(rope, theta: float, scaling: dict | None) -> torch.Tensor:
    """RoPE's inverse frequencies for a Megatron ``RotaryEmbedding`` ``rope``: transformers' and Megatron's
    ``1 / theta ** (2i / dim)`` (float32), then Llama 3 scaling through Megatron's own ``_apply_scaling`` with the
    checkpoint's four values (Megatron's ``rope_scaling=True`` is that call with low/high frequency factors 1 and 4
    and an original context of 8192 hard-coded)."""
    dim = rope.inv_freq.numel() * 2
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling:
        inv = type(rope)._apply_scaling(rope, inv, **scaling)
    return inv


def set_rotary_frequencies(gpt, theta: float, scaling: Mapping | None) -> None:
    """Give ``gpt``'s rotary embedding the checkpoint's frequencies: ``theta`` (the model group's
    ``rotary_base``) and Llama 3 ``scaling`` (its ``rope_scaling``, or None)."""
    rope = getattr(gpt, "rotary_pos_emb", None)
    if rope is None:
        return
    use_inverse_frequencies(gpt, inverse_frequencies(rope, float(theta), dict(scaling) if scaling else None))


def use_inverse_frequencies(gpt, inv_freq: torch.Tensor) -> None:
    """Give ``gpt``'s rotary embedding the inverse frequencies ``inv_freq`` (``[head_dim / 2]``, float32)."""
    rope = gpt.rotary_pos_emb
    rope.inv_freq = inv_freq.to(rope.inv_freq.device)
    type(rope).forward.cache_clear()  # RotaryEmbedding.forward is an lru_cache over (module, lengths)


def never_predict_padding(gpt, vocab: int) -> None:
    """Logits of ``-inf`` on the output layer's rows past ``vocab`` (Megatron's vocabulary padding): the loss's
    softmax gives them probability 0 and gradient 0, and anyone reading the logits sees they are no tokens."""
    layer = getattr(gpt, "output_layer", None)
    if layer is None or not gpt.post_process or gpt.vocab_size <= vocab:
        return
    from megatron.core import parallel_state as ps

    from thdpack.megatron.output_loss import VOCAB_LIMIT

    setattr(gpt, VOCAB_LIMIT, vocab)  # the fused output loss (which never calls the output layer) reads it
    total = gpt.vocab_size
    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    padded = torch.arange(total) >= vocab
    local = padded[rank * total // size : (rank + 1) * total // size]

    def hook(module, args, output):
        logits, bias = output
        mask = padded if logits.shape[-1] == total else local
        return logits.masked_fill(mask.to(logits.device), float("-inf")), bias

    layer.register_forward_hook(hook)
