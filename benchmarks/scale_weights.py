"""Hugging Face weights into this rank's Megatron-core ``GPTModel``, by name: the benchmark's small copy
(Llama and Qwen3-MoE; the names and merges of docs/design.md section 5), so both sides of
``benchmarks/scale.py`` start from the same weights.

Every parameter of this rank gets its slice of the checkpoint: tensor parallelism cuts the fused QKV by query
groups, the gated MLP's gate and up separately, the vocabulary by rows and the row-parallel weights by
columns; pipeline parallelism maps each local layer by its global ``layer_number``; expert parallelism takes
the rank's experts. Both layer specs are known: Transformer Engine's (norms fused into the linear layers,
grouped-GEMM experts ``weight{e}``) and the local one (separate norms, ``local_experts.{e}``). Reads go
through safetensors' slices, so a rank reads its own part of each tensor only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(
    r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))"
)


class Checkpoint:
    """The tensors of a ``save_pretrained`` directory (one ``model.safetensors`` or an index of shards),
    read by name and slice."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").is_file():
            files = None
        else:
            raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
        self.path = path
        self.used: set[str] = set()
        self._handles: dict[str, object] = {}
        self._open = lambda name: safe_open(str(path / name), framework="pt")
        if files is None:
            handle = self._open("model.safetensors")
            self._handles["model.safetensors"] = handle
            files = dict.fromkeys(handle.keys(), "model.safetensors")
        self.files = files

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        """The tensor ``name``, or its rows ``[a, b)`` / columns ``[a, b)``."""
        part = self._slice(name)
        self.used.add(name)
        if rows is not None:
            return part[rows[0] : rows[1]]
        if cols is not None:
            return part[:, cols[0] : cols[1]]
        return part[:]

    def _slice(self, name: str):
        if name not in self.files:
            raise KeyError(f"{self.path}: the checkpoint has no tensor '{name}'")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._open(file)
        return self._handles[file].get_slice(name)


def _split(size: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    if size % parts:
        raise ValueError(f"{what}: {size} does not divide into {parts} tensor-parallel parts")
    step = size // parts
    return rank * step, (rank + 1) * step


def load_hf_weights(model, hf_dir: Path) -> int:
    """Copy ``hf_dir``'s weights into ``model`` (this rank's unwrapped ``GPTModel``), in place; returns the
    number of parameters written. Raises for a parameter the checkpoint has no source for, or whose slice has
    another shape than the rank's parameter."""
    from megatron.core import parallel_state as ps

    ckpt = Checkpoint(hf_dir)
    config = model.config
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    tied = "lm_head.weight" not in ckpt
    written = 0
    for name, param in model.named_parameters():
        if name == "embedding.word_embeddings.weight":
            source = _rows(ckpt, "model.embed_tokens.weight", tp, tp_rank)
        elif name == "output_layer.weight":
            source = _rows(ckpt, "model.embed_tokens.weight" if tied else "lm_head.weight", tp, tp_rank)
        elif name == "decoder.final_layernorm.weight":
            source = ckpt.read("model.norm.weight")
        else:
            match = _LAYER.fullmatch(name)
            if match is None:
                raise ValueError(f"Megatron parameter '{name}' has no Hugging Face source in this copy")
            layer = layer_numbers[int(match.group(1))]
            source = _layer_tensor(ckpt, config, f"model.layers.{layer}.", match.group(2), tp, tp_rank)
        if tuple(source.shape) != tuple(param.shape):
            raise ValueError(
                f"'{name}': the checkpoint's slice for this rank is {list(source.shape)}, the parameter is "
                f"{list(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(source)
        written += 1
    unused = sorted(_owned(ckpt, model, layer_numbers, tied) - ckpt.used)
    if unused:
        raise ValueError(
            f"{hf_dir}: {len(unused)} checkpoint tensors of this rank's part have no place in the Megatron "
            "model "
            f"(a config key its layer spec ignores?): {unused[:6]}"
        )
    return written


def _owned(ckpt: Checkpoint, model, layer_numbers: dict[int, int], tied: bool) -> set[str]:
    """The checkpoint tensors this rank's model must take: its layers' (its experts' only), the embedding on
    the first stage, the final norm and untied output layer on the last."""
    from megatron.core import parallel_state as ps

    owned = {"model.embed_tokens.weight"} if model.pre_process else set()
    if model.post_process:
        owned |= {"model.norm.weight"} | (set() if tied else {"lm_head.weight"})
    experts = model.config.num_moe_experts or 0
    per_rank = experts // ps.get_expert_model_parallel_world_size() if experts else 0
    first = ps.get_expert_model_parallel_rank() * per_rank
    for layer in layer_numbers.values():
        prefix = f"model.layers.{layer}."
        for name in ckpt.files:
            if not name.startswith(prefix):
                continue
            expert = re.match(re.escape(prefix) + r"mlp\.experts\.(\d+)\.", name)
            if expert is None or first <= int(expert.group(1)) < first + per_rank:
                owned.add(name)
    return owned


def _rows(ckpt: Checkpoint, name: str, tp: int, rank: int):
    return ckpt.read(name, rows=_split(ckpt.shape(name)[0], tp, rank, name))


def _cols(ckpt: Checkpoint, name: str, tp: int, rank: int):
    return ckpt.read(name, cols=_split(ckpt.shape(name)[1], tp, rank, name))


def _gated(ckpt: Checkpoint, prefix: str, tp: int, rank: int):
    """``[gate_i; up_i]``: this rank's slice of each, stacked (Megatron's fused ``linear_fc1``)."""
    return torch.cat(
        [_rows(ckpt, f"{prefix}gate_proj.weight", tp, rank), _rows(ckpt, f"{prefix}up_proj.weight", tp, rank)]
    )


def _qkv(ckpt: Checkpoint, config, prefix: str, tp: int, rank: int):
    """Megatron's fused QKV rows for this rank's query groups: per group ``[its query heads, k, v]``."""
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    first, last = _split(groups, tp, rank, f"{prefix}self_attn (query groups)")
    per_group = heads // groups
    q = ckpt.read(f"{prefix}self_attn.q_proj.weight", rows=(first * per_group * dim, last * per_group * dim))
    k = ckpt.read(f"{prefix}self_attn.k_proj.weight", rows=(first * dim, last * dim))
    v = ckpt.read(f"{prefix}self_attn.v_proj.weight", rows=(first * dim, last * dim))
    hidden = q.shape[-1]
    local = last - first
    fused = torch.cat(
        [
            q.reshape(local, per_group * dim, hidden),
            k.reshape(local, dim, hidden),
            v.reshape(local, dim, hidden),
        ],
        dim=1,
    )
    return fused.reshape(-1, hidden)


def _layer_tensor(ckpt: Checkpoint, config, prefix: str, rest: str, tp: int, tp_rank: int):
    """The checkpoint's tensor for ``rest`` (a parameter name inside one Megatron layer), sliced for this
    rank."""
    from megatron.core import parallel_state as ps

    if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return ckpt.read(f"{prefix}input_layernorm.weight")
    if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return ckpt.read(f"{prefix}post_attention_layernorm.weight")
    if rest == "self_attention.linear_qkv.weight":
        return _qkv(ckpt, config, prefix, tp, tp_rank)
    if rest == "self_attention.linear_proj.weight":
        return _cols(ckpt, f"{prefix}self_attn.o_proj.weight", tp, tp_rank)
    if rest == "self_attention.q_layernorm.weight":
        return ckpt.read(f"{prefix}self_attn.q_norm.weight")
    if rest == "self_attention.k_layernorm.weight":
        return ckpt.read(f"{prefix}self_attn.k_norm.weight")
    if rest == "mlp.linear_fc1.weight":
        return _gated(ckpt, f"{prefix}mlp.", tp, tp_rank)
    if rest == "mlp.linear_fc2.weight":
        return _cols(ckpt, f"{prefix}mlp.down_proj.weight", tp, tp_rank)
    if rest == "mlp.router.weight":
        return ckpt.read(f"{prefix}mlp.gate.weight")
    match = _EXPERT.fullmatch(rest)
    if match is None:
        raise ValueError(f"Megatron parameter '{prefix}…{rest}' has no Hugging Face source in this copy")
    local = int(match.group(1) if match.group(1) is not None else match.group(4))
    which = match.group(2) or match.group(3)
    per_rank = config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    expert = ps.get_expert_model_parallel_rank() * per_rank + local
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    expert_prefix = f"{prefix}mlp.experts.{expert}."
    if which == "linear_fc1":
        return _gated(ckpt, expert_prefix, etp, etp_rank)
    return _cols(ckpt, f"{expert_prefix}down_proj.weight", etp, etp_rank)
