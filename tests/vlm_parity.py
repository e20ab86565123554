"""Vision-language parity helpers shared by the L0 test (one rank) and the L1 script (CP2, TP2, under torchrun),
for every VL family (Qwen2.5-VL, Qwen3-VL).

* :func:`mixed_chats`: a text-only sample, a one-image sample and a two-image sample (images of different
  sizes), drawn with PIL;
* :func:`hf_reference`: transformers' own model (``Qwen2_5_VLForConditionalGeneration``,
  ``Qwen3VLForConditionalGeneration``: :func:`hf_class`) on each sample alone (fp32): its logits, and its loss's
  sum and token count on the assistant targets;
* :func:`thdpack_forward`: thdpack's packed forward of the whole batch (collate, pack, CP shard, the VL model
  built from the same directory) on this rank: the logits of this rank's real tokens beside their positions in
  the samples, and the per-token loss sum and count.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

from thdpack import Alignment, pack_bshd
from thdpack.data.collate import collate
from thdpack.data.embedded_vlm import draw_picture
from thdpack.data.vlm import encoded_sample

IMAGE_SIDES = [(56, 84), (56, 56), (112, 84)]  # (min_side, max_side) ranges: three different image sizes


def mixed_chats():
    """``[(messages, images)]``: text only; one image; two images of different sizes."""

    def picture(seed, side_h, side_w):
        rng = np.random.default_rng(seed)
        image, description, _ = draw_picture(rng, 56, 56)
        return image.resize((side_w, side_h)), description

    one, d1 = picture(1, 84, 56)
    a, da = picture(2, 56, 56)
    b, db = picture(3, 112, 84)
    return [
        (
            [
                {"role": "user", "content": "Which shape has three sides?"},
                {"role": "assistant", "content": "The triangle has three sides."},
            ],
            [],
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}],
                },
                {"role": "assistant", "content": d1},
            ],
            [one],
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image"},
                        {"type": "image"},
                        {"type": "text", "text": "Describe the two images."},
                    ],
                },
                {
                    "role": "assistant",
                    "content": f"The first image shows {da[0].lower()}{da[1:-1]}; the second shows {db}",
                },
            ],
            [a, b],
        ),
    ]


def samples(processor, chats):
    return [
        encoded_sample(processor.encode_chat(m, im, f"chat:{i}"), f"chat:{i}")
        for i, (m, im) in enumerate(chats)
    ]


@dataclass
class Reference:
    logits: list[torch.Tensor]  # per sample [L, V]
    loss_sum: float
    loss_count: int


def hf_class(directory):
    """transformers' class of the directory's ``config.json`` architecture."""
    import json
    from pathlib import Path

    import transformers

    (architecture,) = json.loads((Path(directory) / "config.json").read_text())["architectures"]
    return getattr(transformers, architecture)


def hf_reference(directory, sample_list) -> Reference:
    """transformers on each sample alone: logits, and the summed cross entropy over the targets."""
    model = hf_class(directory).from_pretrained(str(directory), dtype=torch.float32).eval()
    takes_types = "mm_token_type_ids" in inspect.signature(model.model.forward).parameters
    logits, loss_sum, count = [], 0.0, 0
    with torch.no_grad():
        for s in sample_list:
            ids = torch.from_numpy(s.tokens)[None]
            kwargs = {}
            grids = s.media["image_grid_thw"]
            if len(grids):
                kwargs["pixel_values"] = torch.from_numpy(s.media["pixel_values"])
                kwargs["image_grid_thw"] = torch.from_numpy(grids)
                if takes_types:
                    kwargs["mm_token_type_ids"] = torch.from_numpy(s.mm_token_type_ids.astype(np.int64))[None]
            out = model(input_ids=ids, use_cache=False, **kwargs).logits[0].float()
            logits.append(out)
            targets = torch.from_numpy(s.tokens[1:])
            keep = torch.from_numpy(s.target_mask[1:])
            losses = torch.nn.functional.cross_entropy(out[:-1], targets, reduction="none")
            loss_sum += float(losses[keep].sum())
            count += int(keep.sum())
    return Reference(logits, loss_sum, count)


def model_group(directory, seq_length: int, tp: int = 1) -> dict:
    from thdpack.hf.checkpoint import HFCheckpoint
    from thdpack.models import model_group as checkpoint_group

    group = checkpoint_group(HFCheckpoint.open(directory), seq_length=seq_length, tp=tp)
    return {**group, "pretrained": str(directory)}


def build(directory, group, parallel: dict, seq_length: int):
    """The VL model (fp32, torch attention, on the CPU) and its TransformerConfig, for the current process
    groups."""
    from thdpack.megatron.config import transformer_config
    from thdpack.megatron.runtime import Runtime
    from thdpack.models import get_family

    runtime = Runtime("cpu", "fp32", "torch")
    model_cfg = {
        k: v
        for k, v in group.items()
        if k
        in (
            "name",
            "position_embedding_type",
            "rotary_base",
            "vocab_size",
            "share_embeddings_and_output_weights",
            "config",
        )
    }
    config = transformer_config(model_cfg, parallel, runtime)
    model = get_family(group["family"]).build(group, config, int(group["vocab_size"]), seq_length, runtime)
    return model.eval(), config


def thdpack_forward(
    model, sample_list, seq_length: int, cp_size: int = 1, cp_rank: int = 0, tp_size: int = 1, sp=False
):
    """This rank's packed forward of the whole batch: ``(logits [t, V] of its real tokens, (sample, position)
    of each, loss sum, loss count)``; logits gathered over TP; None on a pipeline stage before the last."""
    from megatron.core import tensor_parallel

    from thdpack.megatron.packed_seq_params import thd_packed_seq_params

    batch = collate(sample_list, seq_length, pad_id=0, pad_to="longest")
    carried = {k: batch.pop(k) for k in ("pixel_values", "image_grid_thw")}
    mode = "fold" if cp_size > 1 else "distinct"
    packed = pack_bshd(
        batch, alignment=Alignment(cp_size=cp_size, tp_size=tp_size, sequence_parallel=sp, mode=mode)
    )
    shard = packed.shard_for_cp(cp_size, cp_rank)
    labels = shard.labels.masked_fill(shard.labels < 0, 0)
    params = thd_packed_seq_params(shard)
    kwargs = dict(
        packed_seq_params=params,
        pixel_values=carried["pixel_values"],
        image_grid_thw=carried["image_grid_thw"],
        vision_index=shard.extra["vision_index"],
    )
    with torch.no_grad():
        logits = through_the_pipeline(model, shard.tokens, shard.mrope_position_ids, None, **kwargs)
        losses = through_the_pipeline(
            model, shard.tokens, shard.mrope_position_ids, None, labels=labels, **kwargs
        )
    if logits is None:  # not the last pipeline stage: it gave its hidden states to the next one
        return None
    if tp_size > 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    logits = logits.reshape(-1, logits.shape[-1])
    # Where each of this rank's tokens sits in the samples: the packed row's position -> (row, column).
    from thdpack.packing.context_parallel import cp_partition_indices

    positions = torch.arange(packed.total_tokens)
    if cp_size > 1:
        positions = cp_partition_indices(packed.layout.cu_seqlens_padded, cp_size, cp_rank)
    owner = _owners(packed)
    where = [owner.get(int(p)) for p in positions]
    real = [i for i, w in enumerate(where) if w is not None]
    mask = shard.loss_mask.reshape(-1)
    loss_sum = float(torch.where(mask > 0, losses.reshape(-1), torch.zeros(())).sum())
    return logits[real], [where[i] for i in real], loss_sum, int((mask > 0).sum())


def through_the_pipeline(model, tokens, *args, **kwargs):
    """``model(tokens, *args, **kwargs)`` of one micro-batch over the pipeline stages, forward only: a stage after
    the first takes the previous stage's hidden states ``[s, b, hidden]`` (``set_input_tensor``), a stage before
    the last sends its own on. The last stage's output; None on the others. Every stage gets the same arguments
    (the MRoPE ids included: each stage applies them to its own layers)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return model(tokens, *args, **kwargs)
    group = ps.get_pipeline_model_parallel_group()
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank(), group=group)
        model.set_input_tensor(hidden)
    out = model(tokens, *args, **kwargs)
    if ps.is_pipeline_last_stage():
        return out
    dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank(), group=group)
    return None


def _owners(packed) -> dict[int, tuple[int, int]]:
    """packed row position -> (sample row, column) for every real token."""
    seg = packed.segments
    starts = packed.layout.cu_seqlens_padded.tolist()
    out = {}
    for k, (row, start, length) in enumerate(
        zip(seg.row.tolist(), seg.start.tolist(), seg.length.tolist(), strict=True)
    ):
        for j in range(length):
            out[starts[k] + j] = (row, start + j)
    return out


def max_logit_difference(reference: Reference, logits: torch.Tensor, where) -> float:
    vocab = reference.logits[0].shape[-1]
    expected = torch.stack([reference.logits[row][col] for row, col in where])
    return float((logits[:, :vocab] - expected).abs().max())
