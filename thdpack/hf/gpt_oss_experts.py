"""gpt-oss's experts as its checkpoints store them, each layer's fused: ``mlp.experts.gate_up_proj`` ``[E, H, 2I]``
with gate and up interleaved (columns 0, 2, 4... gate, 1, 3, 5... up), ``down_proj`` ``[E, I, H]``, their biases
``[E, 2I]`` and ``[E, H]``, or the weights in MXFP4 (``*_blocks``, ``*_scales``: :mod:`thdpack.hf.mxfp4`; the
released checkpoints), per transformers 5.24's ``GptOssExperts`` and ``integrations/mxfp4.py``.

* import: :class:`ExpertsReader` shows each expert as ``nn.Linear`` tensors, ``mlp.experts.{e}.{gate,up,down}_proj
  .{weight,bias}``, reading (and dequantising) only the asked expert's slice;
* export: :func:`fuse_experts` stacks those per-expert tensors back, unquantised, in the checkpoint's dtype.
"""

from __future__ import annotations

import re

import torch

from .checkpoint import HFCheckpoint

__all__ = ["ExpertsReader", "experts_reader", "fuse_experts"]

_FUSED = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<part>gate_up_proj|down_proj)(?P<form>|_bias|_blocks|_scales)\Z"
)
_PER_EXPERT = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.(?P<kind>weight|bias)\Z"
)


class ExpertsReader:
    """A gpt-oss checkpoint's tensors (``reader``: :class:`~thdpack.hf.checkpoint.SafetensorsReader`) with each
    layer's fused experts shown per expert: ``model.layers.{l}.mlp.experts.{e}.gate_proj.weight`` ``[I, H]``,
    ``up_proj.weight`` ``[I, H]``, ``down_proj.weight`` ``[H, I]`` and their biases. A read touches only the asked
    expert's slice of the fused tensor (dequantised from MXFP4 where the checkpoint stores it so)."""

    def __init__(self, reader, experts: int, hidden: int, intermediate: int):
        self.reader, self.directory = reader, reader.directory
        self.experts, self.hidden, self.intermediate = experts, hidden, intermediate
        names = set(reader.names())
        layers: dict[int, set[str]] = {}
        for name in names:
            m = _FUSED.fullmatch(name)
            if m:
                layers.setdefault(int(m["layer"]), set()).add(m["part"] + m["form"])
        self._quantized: dict[int, bool] = {}
        for layer, parts in sorted(layers.items()):
            self._quantized[layer] = self._check_layer(layer, parts)
        self._names = {n for n in names if not _FUSED.fullmatch(n)} | {
            f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.{kind}"
            for layer in layers
            for e in range(experts)
            for part in ("gate", "up", "down")
            for kind in ("weight", "bias")
        }

    def _fused(self, layer: int, part: str) -> str:
        return f"model.layers.{layer}.mlp.experts.{part}"

    def _check_layer(self, layer: int, parts: set[str]) -> bool:
        """Whether the layer's expert weights are MXFP4; their shapes checked against config.json."""
        e, h, i = self.experts, self.hidden, self.intermediate
        plain = {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h)}
        mxfp4 = {
            "gate_up_proj_blocks": (e, 2 * i, h // 32, 16),
            "gate_up_proj_scales": (e, 2 * i, h // 32),
            "down_proj_blocks": (e, h, i // 32, 16),
            "down_proj_scales": (e, h, i // 32),
        }
        biases = {"gate_up_proj_bias": (e, 2 * i), "down_proj_bias": (e, h)}
        for expected in (plain, mxfp4):
            if parts == set(expected) | set(biases):
                for part, shape in {**expected, **biases}.items():
                    name = self._fused(layer, part)
                    if tuple(self.reader.shape(name)) != shape:
                        raise ValueError(
                            f"{self.reader.where(name)}: '{name}' is {list(self.reader.shape(name))} but config.json "
                            f"(num_local_experts {e}, hidden_size {h}, intermediate_size {i}) needs {list(shape)}"
                        )
                return expected is mxfp4
        raise ValueError(
            f"{self.directory}: layer {layer}'s experts are {sorted(parts)}: gpt-oss stores {sorted({**plain, **biases})}"
            f" or, with MXFP4 experts, {sorted({**mxfp4, **biases})}"
        )

    def names(self) -> set[str]:
        return set(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        m = _PER_EXPERT.fullmatch(name)
        if m is None or not self._is_virtual(m):
            return self.reader.shape(name)
        h, i = self.hidden, self.intermediate
        if m["kind"] == "bias":
            return (h,) if m["part"] == "down" else (i,)
        return (h, i) if m["part"] == "down" else (i, h)

    def _is_virtual(self, m: re.Match) -> bool:
        return int(m["layer"]) in self._quantized

    def _expert(self, layer: int, part: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s ``gate_up_proj`` ``[H, 2I]`` or ``down_proj`` ``[I, H]`` (transformers' layout)."""
        one = slice(expert, expert + 1)
        if not self._quantized[layer]:
            return self.reader.read(self._fused(layer, part), one)[0]
        from .mxfp4 import dequantize_mxfp4

        blocks = self.reader.read(self._fused(layer, part + "_blocks"), one)[0]
        scales = self.reader.read(self._fused(layer, part + "_scales"), one)[0]
        return dequantize_mxfp4(blocks, scales).T  # stored [out, in / 32, 16]: transformers' transpose(1, 2)

    def read(self, name: str, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        m = _PER_EXPERT.fullmatch(name)
        if m is None or not self._is_virtual(m):
            return self.reader.read(name, rows, cols)
        layer, expert, part = int(m["layer"]), int(m["expert"]), m["part"]
        fused = "down_proj" if part == "down" else "gate_up_proj"
        if m["kind"] == "bias":
            bias = self.reader.read(self._fused(layer, fused + "_bias"), slice(expert, expert + 1))[0]
            return (bias if part == "down" else bias[part == "up" :: 2])[rows]
        matrix = self._expert(layer, fused, expert)
        weight = matrix.T if part == "down" else matrix[:, part == "up" :: 2].T  # nn.Linear's [out, in]
        return weight[rows, cols]

    def where(self, name: str) -> str:
        m = _PER_EXPERT.fullmatch(name)
        if m is None or not self._is_virtual(m):
            return self.reader.where(name)
        layer = int(m["layer"])
        part = "down_proj" if m["part"] == "down" else "gate_up_proj"
        part += "_bias" if m["kind"] == "bias" else "_blocks" if self._quantized[layer] else ""
        return f"{self.reader.where(self._fused(layer, part))} (expert {m['expert']})"


def experts_reader(reader) -> ExpertsReader:
    """The checkpoint's tensors (``reader``, of its directory) as :class:`ExpertsReader` shows them."""
    config = HFCheckpoint.open(reader.directory).config
    return ExpertsReader(
        reader,
        int(config["num_local_experts"]),
        int(config["hidden_size"]),
        int(config["intermediate_size"]),
    )


def fuse_experts(
    tensors: dict[str, torch.Tensor], kept: HFCheckpoint | None = None
) -> dict[str, torch.Tensor]:
    """``tensors`` with every layer's per-expert tensors (:class:`ExpertsReader`'s names) fused back as gpt-oss
    stores them unquantised: ``gate_up_proj`` ``[E, H, 2I]`` (gate and up interleaved), ``down_proj``
    ``[E, I, H]`` and their biases; the dtypes and bits as given."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[tuple[int, str, str], torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            out[name] = tensor
        else:
            layers.setdefault(int(m["layer"]), {})[(int(m["expert"]), m["part"], m["kind"])] = tensor
    for layer, parts in sorted(layers.items()):
        experts = range(1 + max(e for e, _, _ in parts))
        missing = [(e, p, k) for e in experts for p in ("gate", "up", "down") for k in ("weight", "bias")]
        missing = [key for key in missing if key not in parts]
        if missing:
            raise ValueError(
                f"layer {layer}'s experts lack {missing[:4]}: every expert's tensors are fused together"
            )
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = torch.stack(
            [_interleave(parts[e, "gate", "weight"].T, parts[e, "up", "weight"].T) for e in experts]
        )
        gate_up_bias = torch.stack(
            [_interleave(parts[e, "gate", "bias"], parts[e, "up", "bias"]) for e in experts]
        )
        out[prefix + "gate_up_proj"] = gate_up
        out[prefix + "gate_up_proj_bias"] = gate_up_bias
        out[prefix + "down_proj"] = torch.stack([parts[e, "down", "weight"].T for e in experts])
        out[prefix + "down_proj_bias"] = torch.stack([parts[e, "down", "bias"] for e in experts])
    return out


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[..., I]`` and ``[..., I]`` as ``[..., 2I]``: gate in the even columns, up in the odd ones."""
    return torch.stack([gate, up], dim=-1).flatten(-2)
