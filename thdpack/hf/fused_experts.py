"""Fused experts (Qwen3-VL-MoE's ``Qwen3VLMoeTextExperts``) and the per-expert tensors of the text Qwen3-MoE.

A layer's experts are two tensors, ``mlp.experts.gate_up_proj`` (every expert's ``[gate; up]``) and
``mlp.experts.down_proj``, in one of two orientations (``E`` experts, hidden ``H``, expert width ``I``):

* ``[E, 2I, H]`` and ``[E, H, I]`` (``nn.Linear``'s ``out x in``): what transformers 5.x's model holds and
  ``save_pretrained`` writes;
* ``[E, H, 2I]`` and ``[E, I, H]`` (``in x out``, the released checkpoints, written by transformers 4.57):
  transformers 5.x transposes them on load (``conversion_mapping.py``: ``Transpose(1, 2, check_dims=True)``).

:func:`in_x_out` is the rule that tells them apart: the pair's shapes, never one tensor alone (``H == 2I`` makes
``gate_up_proj`` ambiguous, and ``H == 2I`` and ``H == I`` cannot both hold). The two directions use it:

* import: :class:`FusedExpertsReader` shows each expert's slice as ``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``,
  ``...up_proj.weight`` ``[I, H]``, ``...down_proj.weight`` ``[H, I]``, reading only the asked slice;
* export: :func:`fuse_experts` stacks those per-expert tensors back into the pair, in the orientation and under
  the names the source directory had.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

__all__ = ["FusedExpertsReader", "fuse_experts", "in_x_out"]

_FUSED = re.compile(
    r"(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<part>gate_up_proj|down_proj)\Z"
)
_PER_EXPERT = re.compile(
    r"(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
    r"(?P<part>gate_proj|up_proj|down_proj)\.weight\Z"
)
_PARTS = ("gate_proj", "up_proj", "down_proj")


def in_x_out(
    where: str,
    layer: int,
    gate_up: Sequence[int],
    down: Sequence[int],
    experts: int,
    hidden: int,
    intermediate: int,
) -> bool:
    """Whether layer ``layer``'s fused experts of shapes ``gate_up`` and ``down`` are stored ``in x out`` (the
    released checkpoints: ``[E, H, 2I]``, ``[E, I, H]``) rather than ``out x in`` (transformers 5.x: ``[E, 2I, H]``,
    ``[E, H, I]``). Raises ``ValueError`` naming ``where`` (the ``gate_up_proj`` tensor) for shapes that fit neither."""
    e, h, i = experts, hidden, intermediate
    gate_up, down = tuple(gate_up), tuple(down)
    if gate_up == (e, 2 * i, h) and down == (e, h, i):
        return False
    if gate_up == (e, h, 2 * i) and down == (e, i, h):
        return True
    raise ValueError(
        f"{where}: layer {layer}'s fused experts are gate_up_proj {list(gate_up)} and down_proj {list(down)}, but "
        f"config.json (num_experts {e}, hidden_size {h}, moe_intermediate_size {i}) needs [{e}, {2 * i}, {h}] and "
        f"[{e}, {h}, {i}] (transformers 5.x) or [{e}, {h}, {2 * i}] and [{e}, {i}, {h}] (the released checkpoints)"
    )


class FusedExpertsReader:
    """A checkpoint's language model with fused experts as the text Qwen3-MoE import reads it: the tensors of
    ``reader`` (text-model names, e.g. :class:`~thdpack.hf.vl_checkpoint.LanguageModelReader`), with each layer's
    fused pair shown as ``model.layers.{l}.mlp.experts.{e}.{gate_proj,up_proj}.weight`` ``[I, H]`` and
    ``...{e}.down_proj.weight`` ``[H, I]`` (``nn.Linear`` weights of expert ``e``). A read touches only the asked
    expert's slice of the fused tensor (its rows on the fused tensor's second dimension; the rest of the expert is
    cut in memory)."""

    def __init__(self, reader, experts: int, hidden: int, intermediate: int):
        self.reader, self.directory = reader, reader.directory
        self._names = set(reader.names())
        # name -> (fused name, expert, part, in x out)
        self._virtual: dict[str, tuple[str, int, str, bool]] = {}
        layers: dict[int, dict[str, str]] = {}
        for name in self._names:
            m = _FUSED.fullmatch(name)
            if m and m["prefix"] == "model.":
                layers.setdefault(int(m["layer"]), {})[m["part"]] = name
        for layer, fused in sorted(layers.items()):
            if set(fused) != {"gate_up_proj", "down_proj"}:
                raise ValueError(
                    f"{self.where(next(iter(fused.values())))}: layer {layer} holds {sorted(fused)} of its fused "
                    "experts: gate_up_proj and down_proj go together"
                )
            transposed = in_x_out(
                self.where(fused["gate_up_proj"]),
                layer,
                reader.shape(fused["gate_up_proj"]),
                reader.shape(fused["down_proj"]),
                experts,
                hidden,
                intermediate,
            )
            self._names -= set(fused.values())
            for expert in range(experts):
                prefix = f"model.layers.{layer}.mlp.experts.{expert}."
                for part, source in (("gate", "gate_up_proj"), ("up", "gate_up_proj"), ("down", "down_proj")):
                    self._virtual[f"{prefix}{part}_proj.weight"] = (fused[source], expert, part, transposed)
        self._shapes = {
            "gate": (intermediate, hidden),
            "up": (intermediate, hidden),
            "down": (hidden, intermediate),
        }
        self._intermediate = intermediate

    def names(self) -> set[str]:
        return self._names | set(self._virtual)

    def shape(self, name: str):
        if name in self._virtual:
            return self._shapes[self._virtual[name][2]]
        return self.reader.shape(name)

    def read(self, name: str, rows=slice(None), cols=slice(None)):
        if name not in self._virtual:
            return self.reader.read(name, rows, cols)
        fused, expert, part, transposed = self._virtual[name]
        # The virtual tensor's rows within the fused tensor: the up half of gate_up follows the gate half.
        offset = self._intermediate if part == "up" else 0
        n_rows, _ = self._shapes[part]
        start, stop, _ = rows.indices(n_rows)
        rows = slice(start + offset, stop + offset)
        expert = slice(expert, expert + 1)
        if not transposed:  # [E, out, in]: the expert's out rows, then its in columns
            return self.reader.read(fused, expert, rows)[0][:, cols]
        return self.reader.read(fused, expert, cols)[0][:, rows].T  # [E, in, out]

    def where(self, name: str) -> str:
        if name in self._virtual:
            fused, expert, _, _ = self._virtual[name]
            return f"{self.reader.where(fused)} (expert {expert})"
        return self.reader.where(name)


def fuse_experts(
    tensors: Mapping[str, torch.Tensor],
    source_shapes: Mapping[str, Sequence[int]],
    experts: int,
    hidden: int,
    intermediate: int,
    checkpoint: str,
    source: str,
) -> dict[str, torch.Tensor]:
    """``tensors`` with every layer's per-expert ``...layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``
    (``nn.Linear`` weights, under any prefix: ``model.`` or ``model.language_model.``) replaced by the layer's
    ``...layers.{l}.mlp.experts.gate_up_proj`` (``[gate; up]`` of each expert) and ``...down_proj``, each in the
    orientation of ``source_shapes[name]`` (:func:`in_x_out`). The tensors keep their dtype and bits.

    Raises ``ValueError`` naming the tensor and the rule when a layer lacks an expert's tensor (``checkpoint``: where
    ``tensors`` come from), gives an expert past ``experts``, or when ``source_shapes`` (read at ``source``) has no
    fused pair for the layer or one of neither orientation."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[tuple[str, int], dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            out[name] = tensor
        else:
            layers.setdefault((m["prefix"], int(m["layer"])), {})[(int(m["expert"]), m["part"])] = tensor
    for (prefix, layer), parts in sorted(layers.items()):
        expert_name = f"{prefix}layers.{layer}.mlp.experts.{{}}.{{}}.weight".format
        extra = sorted(expert_name(e, p) for e, p in parts if e >= experts)
        if extra:
            raise ValueError(
                f"{checkpoint}: the checkpoint gives {extra[:4]} but num_experts is {experts}: the checkpoint is "
                "not of this model"
            )
        missing = [expert_name(e, p) for e in range(experts) for p in _PARTS if (e, p) not in parts]
        if missing:
            raise ValueError(
                f"{checkpoint}: the checkpoint gives no {missing[:4]} ({len(missing)} missing): layer {layer}'s "
                f"experts are written fused, one gate_up_proj and one down_proj holding all {experts} experts "
                "(num_experts), so every expert's gate_proj, up_proj and down_proj is needed"
            )
        gate_up_name, down_name = (
            f"{prefix}layers.{layer}.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")
        )
        absent = [n for n in (gate_up_name, down_name) if n not in source_shapes]
        if absent:
            raise ValueError(
                f"{source}: the source directory has no {absent}: layer {layer}'s experts are written as the "
                "source stored them, fused into gate_up_proj and down_proj, in the source's orientation"
            )
        transposed = in_x_out(
            f"{source} ('{gate_up_name}')",
            layer,
            source_shapes[gate_up_name],
            source_shapes[down_name],
            experts,
            hidden,
            intermediate,
        )
        gate_up = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(experts)]
        )  # [E, 2I, H]
        down = torch.stack([parts[(e, "down_proj")] for e in range(experts)])  # [E, H, I]
        if transposed:
            gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        out[gate_up_name], out[down_name] = gate_up, down
    return out
