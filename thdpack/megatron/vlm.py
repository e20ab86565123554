"""A vision-language model on Megatron-core: Megatron's ``GPTModel`` with packed MRoPE as the language model, a
Hugging Face vision tower beside it, image embeddings scattered into the token embeddings of packed rows.

Per micro-batch (first pipeline stage):

1. the vision tower (transformers' module, :mod:`thdpack.models.qwen2_5_vl`) runs on every image of the micro-batch
   (``pixel_values [P, D]``, ``image_grid_thw [I, 3]``; its own variable-length attention per image and
   window, boundaries from the grids) and gives one embedding per image token ``[N, hidden]``, in row-major
   order of the micro-batch's image tokens;
2. the language model's embedding runs on this rank's tokens (``[s, 1, hidden]``, the whole CP shard: before
   any sequence-parallel split);
3. each image token takes its embedding: ``vision_index`` (token-aligned, packed and CP-sharded with the tokens
   by :func:`thdpack.megatron.batch.get_batch`) holds 1 + the row of step 1's output for an image token, 0
   elsewhere. So every CP rank runs the vision tower on the micro-batch's images and keeps the rows of its own
   image tokens: vision tokens need not divide evenly over CP ranks, and nothing is exchanged. A gather and a
   ``where``: no data-dependent shape, no host sync;
4. with sequence parallelism the embeddings are then split over the TP group (Megatron's embedding would have
   split them first), and ``GPTModel`` runs on them as ``decoder_input``;
5. a vision tower with DeepStack (Qwen3-VL) also gives one feature map per DeepStack layer ``[N, hidden]``: they
   ride with the call to the first decoder layers, which add them at the image tokens
   (:mod:`thdpack.megatron.deepstack`, with the same ``vision_index``).

Gradients: the vision tower is frozen by default (``model.freeze_vision``: its forward runs without autograd);
trained, each TP rank computes the same full gradient (the split in step 4 comes after the scatter), each CP rank
the part of its own image tokens, summed with the data-parallel reduction (over DP x CP). Under TP the vision
tower is replicated on every rank. Embedding dropout, when configured, does not touch image embeddings
(transformers has none).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from megatron.core.transformer.module import MegatronModule

__all__ = ["VisionLanguageModel", "build_language_model", "vlm_batch_transform", "vlm_forward"]


class VisionLanguageModel(MegatronModule):
    """``GPTModel`` (``language_model``) with a vision tower (``visual``, on the first pipeline stage only).

    Args:
        config: the language model's ``TransformerConfig``.
        language_model: this stage's ``GPTModel`` (MRoPE, packed: :func:`thdpack.megatron.models.build_gpt_model`).
        visual: the vision tower and merger (``pixel_values, grid_thw -> [N, hidden]`` image-token embeddings),
            None on stages without the embedding.
        freeze_vision: keep the vision tower's weights fixed (no gradient, no optimizer state).
        deepstack_layers: DeepStack (Qwen3-VL): the vision tower also returns this many feature maps, added
            after decoder layers 1..``deepstack_layers`` (:mod:`thdpack.megatron.deepstack`); 0: none.
    """

    def __init__(
        self, config, language_model, visual=None, freeze_vision: bool = True, deepstack_layers: int = 0
    ):
        super().__init__(config)
        self.language_model = language_model
        self.model_type = language_model.model_type  # Megatron's schedules read it off the wrapped model
        self.pre_process = language_model.pre_process
        self.post_process = language_model.post_process
        self.freeze_vision = freeze_vision
        if self.pre_process and visual is None:
            raise ValueError("the first pipeline stage needs the vision tower")
        self.visual = visual if self.pre_process else None
        if self.visual is not None:
            _keep_vision_rotary_fp32(self.visual)
            if freeze_vision:
                self.visual.requires_grad_(False)
        if self.pre_process:
            # Step 2 of the module docstring: the embedding leaves the sequence-parallel split to forward().
            embedding = language_model.embedding
            embedding.reduce_scatter_embeddings = False
            embedding.word_embeddings.reduce_scatter_embeddings = False
            embedding.scatter_to_sequence_parallel = False
        self.deepstack_layers = int(deepstack_layers)
        if self.deepstack_layers:
            from .deepstack import check_deepstack_placement, enable_deepstack

            check_deepstack_placement(language_model, self.deepstack_layers, self.pre_process)
            if not freeze_vision and config.recompute_granularity == "full":
                # A recomputed layer would backpropagate into the vision graph on its own, before the
                # embedding scatter's backward reaches the same graph (freed by then).
                raise ValueError(
                    "model.freeze_vision=false with full activation recomputation is not supported for a "
                    "DeepStack model (Qwen3-VL): keep the vision tower frozen or use selective recomputation"
                )
            enable_deepstack(language_model, self.deepstack_layers)

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language_model.share_embeddings_and_output_weights

    @property
    def vocab_size(self) -> int:
        """The language model's padded vocabulary (what a checkpoint records, as for a bare ``GPTModel``)."""
        return self.language_model.vocab_size

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        labels=None,
        packed_seq_params=None,
        padding_mask=None,
        pixel_values=None,
        image_grid_thw=None,
        vision_index=None,
    ):
        """``GPTModel.forward``'s arguments plus the micro-batch's images (see the module docstring):
        ``pixel_values [P, D]``, ``image_grid_thw [I, 3]`` and ``vision_index`` ``[b, s]`` (this rank's tokens)."""
        decoder_input = None
        if self.pre_process:
            decoder_input, deepstack = self.embed(input_ids, pixel_values, image_grid_thw, vision_index)
            if deepstack:
                from .deepstack import with_deepstack

                packed_seq_params = with_deepstack(packed_seq_params, deepstack, vision_index)
            if padding_mask is not None and self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                # What GPTModel does to the padding mask when it embeds the tokens itself.
                padding_mask = (
                    tensor_parallel.scatter_to_sequence_parallel_region(
                        padding_mask.transpose(0, 1).contiguous()
                    )
                    .transpose(0, 1)
                    .contiguous()
                )
        return self.language_model(
            input_ids,
            position_ids,
            attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )

    def image_embeddings(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``([N, hidden], [[N, hidden]] * deepstack_layers)``: the vision tower's merged output, one row per image
        token, images in order, and its DeepStack feature maps in the same rows (none without DeepStack)."""
        dtype = next(self.visual.parameters()).dtype
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_vision):
            out = self.visual(pixel_values.to(dtype), grid_thw=image_grid_thw)
        # transformers >= 5: a ModelOutput whose pooler_output is the merger's output (and, for Qwen3-VL,
        # deepstack_features the DeepStack mergers'); before: the tensor, or (merged, deepstack features).
        if isinstance(out, tuple):
            merged, deepstack = out
        else:
            merged = getattr(out, "pooler_output", out)
            deepstack = getattr(out, "deepstack_features", None) or []
        if len(deepstack) != self.deepstack_layers:
            raise ValueError(
                f"the vision tower returned {len(deepstack)} DeepStack feature maps but the model adds "
                f"{self.deepstack_layers} (vision_config.deepstack_visual_indexes)"
            )
        return merged, list(deepstack)

    def embed(
        self, input_ids, pixel_values=None, image_grid_thw=None, vision_index=None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Token embeddings ``[s, b, hidden]`` with image embeddings at the image tokens (``[s / tp, b,
        hidden]`` under sequence parallelism), and the micro-batch's DeepStack feature maps (``[N, hidden]``
        each; none without images or without DeepStack)."""
        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=None)
        deepstack = []
        if image_grid_thw is not None and image_grid_thw.numel():
            if vision_index is None:
                raise ValueError(
                    "a micro-batch with images needs 'vision_index' (thdpack.data.collate writes it)"
                )
            images, deepstack = self.image_embeddings(pixel_values, image_grid_thw)
            images = images.to(embeddings.dtype)
            index = vision_index.transpose(0, 1)  # [s, b], as the embeddings
            rows = images[
                (index - 1).clamp(min=0)
            ]  # [s, b, hidden]; index 0 (text) reads row 0, then dropped
            embeddings = torch.where((index > 0).unsqueeze(-1), rows, embeddings)
        if self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        return embeddings, deepstack


def _keep_vision_rotary_fp32(visual) -> None:
    """The vision tower's rotary inverse frequencies stay float32 whatever dtype the module is cast to
    (Megatron's Float16Module casts buffers too; transformers computes the rotary in float32)."""
    rotary = getattr(visual, "rotary_pos_emb", None)
    inv = getattr(rotary, "inv_freq", None)
    if inv is None:
        return
    reference = inv.detach().float().clone()

    def hook(module, args):
        if module.inv_freq.dtype != torch.float32:
            module.inv_freq = reference.to(module.inv_freq.device)

    rotary.register_forward_pre_hook(hook)


def build_language_model(
    model: Mapping,
    config,
    vocab_size: int,
    max_sequence_length: int,
    runtime,
    mrope_interleaved: bool = False,
):
    """This rank's ``GPTModel`` chunk of a vision-language model's language model (MRoPE, packed), random weights:
    the recipe's model group (``rotary_base``, ``share_embeddings_and_output_weights``, ``te_op_fuser``) and
    Megatron's config; ``mrope_interleaved``: Qwen3-VL's MRoPE frequency layout. The family that builds the whole
    model loads the checkpoint into it (:mod:`thdpack.models.vl`)."""
    from .models import build_gpt_model

    return build_gpt_model(
        config,
        vocab_size,
        max_sequence_length,
        backend=runtime.backend,
        position_embedding_type="mrope",
        mrope_interleaved=mrope_interleaved,
        rotary_base=float(model.get("rotary_base", 1000000.0)),
        share_embeddings_and_output_weights=bool(model.get("share_embeddings_and_output_weights", False)),
        te_op_fuser=model.get("te_op_fuser") is True,  # "auto" is resolved with the recipe
    )


def vlm_forward(model, inputs):
    """One micro-batch through the (wrapped) :class:`VisionLanguageModel`: ``inputs`` as
    :func:`thdpack.megatron.batch.get_batch` builds them, the images in ``inputs.extra``."""
    extra = inputs.extra
    return model(
        inputs.tokens,
        inputs.position_ids,
        inputs.attention_mask,
        labels=inputs.labels,
        packed_seq_params=inputs.packed_seq_params,
        padding_mask=inputs.padding_mask,
        pixel_values=extra.get("pixel_values"),
        image_grid_thw=extra.get("image_grid_thw"),
        vision_index=extra.get("vision_index"),
    )


def vlm_batch_transform(batch: dict) -> dict:
    """The family's batch hook (on the reader's host batch, before packing): a micro-batch without images gets
    empty ``pixel_values [0, 0]`` / ``image_grid_thw [0, 3]``, so every micro-batch carries the same keys; one
    with images must hold as many patch rows as its grids (checked here, on the host, not inside the vision
    tower)."""
    if batch.get("image_grid_thw") is None:
        batch["image_grid_thw"] = torch.zeros(0, 3, dtype=torch.int64)
        batch["pixel_values"] = torch.zeros(0, 0, dtype=torch.float32)
        return batch
    grids, pixels = batch["image_grid_thw"], batch.get("pixel_values")
    patches = int(grids.prod(dim=-1).sum()) if grids.numel() else 0
    if patches and (pixels is None or pixels.shape[0] != patches):
        rows = None if pixels is None else pixels.shape[0]
        raise ValueError(
            f"the micro-batch's image grids hold {patches} patches but pixel_values has {rows} rows"
        )
    return batch
