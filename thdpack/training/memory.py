"""Will the model fit? An estimate of one process's memory from the recipe alone, checked before anything is
allocated: a model too large for the device is refused with the estimate and what to change, instead of being
killed by the kernel (CPU) or running out of memory in the first step (GPU).

The estimate, per process (the largest pipeline stage):

* parameters from the shapes (the count transformers' own models give, checked in tests), split over TP and PP,
  experts over EP;
* bytes per parameter under Megatron's DDP with fp32 gradient buffers and the distributed optimizer: weights
  (2 in bf16, 4 in fp32) + gradients (4) + optimizer states sharded over the data- and context-parallel ranks
  (Adam's two moments, 8, and in bf16 the fp32 main weights, 4): ``6 + 12 / (dp cp)`` bytes in bf16,
  ``8 + 8 / (dp cp)`` in fp32; under
  LoRA (``peft=lora``) gradients and optimizer states of the adapters only, the frozen base its weights alone;
* activations, a rough figure: per token and layer the tensors a layer keeps for its backward (the inputs of the
  norms and projections, q/k/v, the attention output, the MLP's hidden activations; no attention-score matrix:
  the attention kernels are flash-style), for the micro-batches a pipeline stage holds at once; under full
  activation recomputation each recomputed chunk's input and one chunk's activations at a time;
* the logits and their fp32 cross-entropy copies (``tokens x vocab``);
* the process itself (Python, torch, megatron-core).

Measured against it: on one H100 (Transformer Engine, bf16), llama3_1b with 16,384-token micro-batches peaked at
51.2 GiB (``benchmarks/results/e2e_h100_2026-11-24.md``), estimated 60.3; on this CPU (thdpack's torch attention,
fp32, unfused RoPE and norms), a 0.19B GPT (hidden 1024, 8 layers, vocabulary 32000) with 4,096-token
micro-batches peaked at 10.8 GiB resident, so activations and logits off Transformer Engine count
:data:`UNFUSED_FACTOR` times. Rough where activations are concerned: a run is refused only when the estimate
passes the available memory by more than :data:`MARGIN`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from thdpack.megatron.output_loss import default_chunk_tokens, resolve_output_loss

from .config_error import ConfigError

__all__ = ["MARGIN", "MemoryEstimate", "check_memory", "estimate_memory", "parameter_count"]

GIB = 2**30
# Refused when the estimate is above 1.25 x what is available: the activation figure is rough.
MARGIN = 1.25
# Peak resident memory of `python -m thdpack.train trainer.train_iters=2 dataset.max_files=20` (tiny_gpt, CPU):
# 0.44 GiB, nearly all of it Python, torch and megatron-core.
PROCESS_BYTES = 0.5 * GIB
SHAPE_KEYS = frozenset({"num_layers", "hidden_size", "num_attention_heads"})
BYTE_TOKENIZER_VOCAB = 259  # thdpack.data.tokenizer.ByteTokenizer
# Without Transformer Engine's fused kernels (RoPE, norm + linear) a layer keeps more intermediates: this CPU's
# measurement (10.8 GiB peak against 7.2 estimated with a factor of 1) puts activations and logits at about 1.9x;
# 2 keeps the estimate at or above it.
UNFUSED_FACTOR = 2.0


@dataclass(frozen=True)
class ParameterCount:
    """Parameters by where they live: each transformer layer's dense part and its experts, the embedding, the
    output layer (0 when tied to the embedding) and the final norm."""

    layer_dense: int
    layer_experts: int
    embedding: int
    output: int
    final_norm: int
    num_layers: int

    @property
    def total(self) -> int:
        layers = self.num_layers * (self.layer_dense + self.layer_experts)
        return layers + self.embedding + self.output + self.final_norm


def parameter_count(model: Mapping, vocab_size: int) -> ParameterCount:
    """The parameters of the GPT that ``model`` (a recipe's ``model`` group) describes, with ``vocab_size`` rows
    of embedding."""
    c = model.get("config") or {}
    h = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    groups = int(c.get("num_query_groups") or heads)
    head_dim = int(c.get("kv_channels") or h // heads)
    bias = bool(c.get("add_bias_linear", True))
    qkv_bias = bool(c.get("add_qkv_bias", False)) or bias
    attention = h * head_dim * (heads + 2 * groups) + heads * head_dim * h
    attention += qkv_bias * head_dim * (heads + 2 * groups) + bias * h
    norm = h * (2 if c.get("normalization", "LayerNorm") == "LayerNorm" else 1)
    attention += norm + (2 * head_dim if c.get("qk_layernorm") else 0)  # input norm, q/k norms
    width = 2 if c.get("gated_linear_unit") else 1

    def mlp(ffn: int) -> int:
        return width * h * ffn + ffn * h + bias * (width * ffn + h)

    experts = int(c.get("num_moe_experts") or 0)
    if experts:
        ffn = int(c.get("moe_ffn_hidden_size") or c.get("ffn_hidden_size") or 4 * h)
        dense = attention + norm + h * experts  # pre-MLP norm, router
        shared = c.get("moe_shared_expert_intermediate_size")
        dense += mlp(int(shared)) if shared else 0
        layer_experts = experts * mlp(ffn)
    else:
        dense, layer_experts = attention + norm + mlp(int(c.get("ffn_hidden_size") or 4 * h)), 0
    tied = bool(model.get("share_embeddings_and_output_weights", False))
    return ParameterCount(
        layer_dense=dense,
        layer_experts=layer_experts,
        embedding=vocab_size * h,
        output=0 if tied else vocab_size * h,
        final_norm=norm,
        num_layers=int(c["num_layers"]),
    )


def lora_layer_parameters(model: Mapping, peft: Mapping) -> int:
    """The LoRA adapters' parameters of one layer: ``rank x (in + out)`` of each adapted module
    (``peft.target_modules``, resolved) of a Llama-like layer; MoE layers have no adapted MLP."""
    c = model.get("config") or {}
    h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    groups = int(c.get("num_query_groups") or heads)
    head_dim = int(c.get("kv_channels") or h // heads)
    ffn = 0 if c.get("num_moe_experts") else int(c.get("ffn_hidden_size") or 4 * h)
    sizes = {
        "q_proj": h + heads * head_dim,
        "k_proj": h + groups * head_dim,
        "v_proj": h + groups * head_dim,
        "o_proj": heads * head_dim + h,
        "gate_proj": (h + ffn) if ffn else 0,
        "up_proj": (h + ffn) if ffn else 0,
        "down_proj": (ffn + h) if ffn else 0,
    }
    return int(peft["rank"]) * sum(sizes.get(name, h + h) for name in peft["target_modules"])


@dataclass(frozen=True)
class MemoryEstimate:
    """One process's memory in bytes (its largest pipeline stage), by what holds it."""

    parameters: int  # on this process
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    process: float
    tokens: int  # per micro-batch, all ranks of a context-parallel group together

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.process

    def describe(self, tokens_from: str = "") -> str:
        """The figures in words; ``tokens_from`` says what sets the micro-batch's tokens."""

        def g(x: float) -> str:
            return f"{x / GIB:.1f}"

        return (
            f"{g(self.total)} GiB: weights {g(self.weights)}, gradients {g(self.gradients)}, optimizer states "
            f"{g(self.optimizer)} ({self.parameters / 1e9:.2f}B parameters on this process), activations about "
            f"{g(self.activations)} and logits {g(self.logits)} for {self.tokens}-token micro-batches"
            + (f" ({tokens_from})" if tokens_from else "")
            + ", the process "
            f"{g(self.process)}"
        )


def precision_of(trainer: Mapping, device: str) -> str:
    """``trainer.precision`` made concrete as thdpack's runtime does: ``auto`` is bf16 on CUDA, fp32 else."""
    precision = trainer.get("precision", "auto")
    return ("bf16" if device == "cuda" else "fp32") if precision == "auto" else str(precision)


def estimate_memory(
    cfg: Mapping, *, world_size: int, device: str, backend: str, data_tokens: int | None = None
) -> MemoryEstimate:
    """The estimate for one of ``world_size`` processes on ``device`` with the attention ``backend`` (``te`` or
    ``torch``; see the module's docstring). ``data_tokens``: the most tokens a micro-batch of the run's data holds
    (:meth:`thdpack.data.loader.TrainData.largest_micro_batch_tokens`), when below what the recipe allows."""
    model, dataset, parallel = cfg["model"], cfg["dataset"], cfg["parallel"]
    c = model.get("config") or {}
    tp, pp = int(parallel["tensor_model_parallel_size"]), int(parallel["pipeline_model_parallel_size"])
    cp, ep = int(parallel["context_parallel_size"]), int(parallel["expert_model_parallel_size"])
    dp = max(1, world_size // (tp * pp * cp))
    expert_dp = max(1, world_size // (tp * pp * ep))
    vocab = int(model.get("vocab_size") or BYTE_TOKENIZER_VOCAB)
    vocab = -(-vocab // (128 * tp)) * 128 * tp  # Megatron pads the vocabulary to a multiple of 128 x TP
    count = parameter_count(model, vocab)

    layers = math.ceil(count.num_layers / pp)
    first = count.embedding + (count.output + count.final_norm if pp == 1 else 0)
    last = (
        count.output or count.embedding
    ) + count.final_norm  # a tied output layer is a copy on the last stage
    ends = first if pp == 1 else max(first, last)
    dense = (layers * count.layer_dense + ends) / tp
    experts = layers * count.layer_experts / (tp * ep)
    params = dense + experts

    precision = precision_of(cfg["trainer"], device)
    weight_bytes = 2 if precision in ("bf16", "fp8") else 4  # fp8: bf16 weights, FP8 only inside the GEMMs
    state_bytes = 12 if weight_bytes == 2 else 8  # (fp32 main weights +) Adam's two moments
    # the distributed optimizer shards the dense parameters' states over the data- and context-parallel ranks
    # together (megatron-core's DDP reduces their gradients over both), the experts' over the expert-data-parallel
    optimizer = state_bytes * (dense / (dp * cp) + experts / expert_dp)
    trained = params
    peft = cfg.get("peft") or {}
    if peft.get("name") == "lora":  # the base frozen: gradients and optimizer states of the adapters only
        trained = layers * lora_layer_parameters(model, peft) / tp
        params += trained
        optimizer = state_bytes * trained / (dp * cp)

    tokens = _micro_batch_tokens(dataset)
    if data_tokens is not None:
        tokens = min(tokens, data_tokens)
    h = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    groups = int(c.get("num_query_groups") or heads)
    head_dim = int(c.get("kv_channels") or h // heads)
    width = 2 if c.get("gated_linear_unit") else 1
    sp = bool(parallel.get("sequence_parallel", False)) and tp > 1
    replicated = 5 * h  # the norms' and projections' inputs, the residuals
    split = 2 * heads * head_dim + 2 * groups * head_dim  # q and the attention output, k and v
    if c.get("num_moe_experts"):
        topk = int(c.get("moe_router_topk") or 2)
        ffn = int(c.get("moe_ffn_hidden_size") or c.get("ffn_hidden_size") or 4 * h)
        split += topk * ((width + 1) * ffn + 2 * h)  # each routed copy: dispatched input, hidden, output
    else:
        split += (width + 1) * int(c.get("ffn_hidden_size") or 4 * h)  # Megatron: 4h when unset
    per_token_layer = replicated / (tp if sp else 1) + split / tp
    kept_layers = _kept_layers(c, layers, per_token_layer, h / (tp if sp else 1))
    num_micro = _microbatches(dataset, dp)
    in_flight = min(pp, num_micro) if pp > 1 else 1
    unfused = 1.0 if backend == "te" else UNFUSED_FACTOR
    activations = unfused * tokens / cp * kept_layers * in_flight * weight_bytes
    # the logits, their fp32 copy, its gradient: of every token with Megatron's output loss, of one chunk of
    # tokens with the fused ones (thdpack.megatron.output_loss never keeps a [tokens, vocab] tensor)
    logit_rows = tokens / cp
    if resolve_output_loss(model, device) != "megatron":
        logit_rows = min(logit_rows, default_chunk_tokens(vocab // tp))
    logits = unfused * logit_rows * vocab / tp * (weight_bytes + 8)
    return MemoryEstimate(
        parameters=int(params),
        weights=params * weight_bytes,
        gradients=trained * 4,
        optimizer=optimizer,
        activations=activations,
        logits=logits,
        process=PROCESS_BYTES,
        tokens=tokens,
    )


def _kept_layers(c: Mapping, layers: int, per_layer: float, layer_input: float) -> float:
    """What a stage's layers keep for the backward, per token, in elements. Megatron's full activation
    recomputation (``recompute_granularity=full``) keeps each recomputed chunk's input only and rebuilds one
    chunk's activations at a time: ``uniform`` chunks of ``recompute_num_layers`` layers, ``block`` the first
    ``recompute_num_layers`` layers one by one and the rest whole. Selective recomputation (attention's core,
    flash-style already) is counted as none."""
    if c.get("recompute_granularity") != "full":
        return layers * per_layer
    n = max(1, min(int(c.get("recompute_num_layers") or 1), layers))
    if c.get("recompute_method", "uniform") == "block":
        return n * layer_input + (layers - n) * per_layer + per_layer
    return math.ceil(layers / n) * layer_input + n * per_layer


def _micro_batch_tokens(dataset: Mapping) -> int:
    budget = dataset.get("micro_batch_tokens", "auto")
    if dataset["pack_sequences_in_batch"] and budget not in (None, "auto"):
        return int(budget)
    return int(dataset["micro_batch_size"]) * int(dataset["seq_length"])


def _microbatches(dataset: Mapping, dp: int) -> int:
    return max(1, int(dataset["global_batch_size"]) // (int(dataset["micro_batch_size"]) * dp))


def available_memory(device: str) -> tuple[int, int, str]:
    """``(bytes, processes sharing them, where)``: the GPU's free memory for this process, or the host's
    available memory shared by the processes torchrun starts on it."""
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", 0)))
        return free, 1, f"GPU {os.environ.get('LOCAL_RANK', 0)} has"
    import psutil

    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return psutil.virtual_memory().available, processes, "this host has"


def check_memory(
    cfg: Mapping,
    *,
    world_size: int,
    device: str,
    backend: str,
    available: int | None = None,
    data_tokens: int | None = None,
) -> None:
    """Raise :class:`ConfigError` when the estimate (:func:`estimate_memory`) of this host's processes passes the
    memory available to them by more than :data:`MARGIN`; ``available`` (bytes) replaces the measured figure;
    ``data_tokens``: the largest micro-batch the data fills (sizes the activations when below the recipe's).
    ``trainer.memory_check=false`` skips the check."""
    if not cfg["trainer"].get("memory_check", True):
        return
    if not SHAPE_KEYS.issubset(cfg["model"].get("config") or {}):
        return  # the shape comes from elsewhere (a checkpoint's config): nothing to estimate from yet
    estimate = estimate_memory(
        cfg, world_size=world_size, device=device, backend=backend, data_tokens=data_tokens
    )
    if available is None:
        available, processes, where = available_memory(device)
    else:
        processes, where = 1, "the device has"
    need = estimate.total * processes
    if need <= MARGIN * available:
        return
    model = cfg["model"].get("name", "the model")
    per = f" for {processes} processes" if processes > 1 else ""
    raise ConfigError(
        f"model={model} needs about {estimate.describe(_tokens_source(cfg['dataset'], estimate.tokens, data_tokens))}"
        + (f" per process, {need / GIB:.1f} GiB in all" if processes > 1 else "")
        + f"; {where} {available / GIB:.1f} GiB available{per} (refused above {MARGIN:g}x that). To fit: "
        + _remedies(cfg, estimate, device)
        + ". trainer.memory_check=false runs it anyway.",
        every_rank=device == "cuda",  # each GPU's free memory is its own
    )


def _tokens_source(dataset: Mapping, tokens: int, data_tokens: int | None) -> str:
    """Which keys make the micro-batch ``tokens`` long: what to change to shrink it."""
    if data_tokens is not None and data_tokens == tokens:
        return "the most the data's samples fill in one micro-batch"
    if dataset["pack_sequences_in_batch"] and dataset.get("micro_batch_tokens") not in (None, "auto"):
        return f"dataset.micro_batch_tokens={tokens}, by default micro_batch_size x seq_length"
    return f"dataset.micro_batch_size={dataset['micro_batch_size']} x seq_length={dataset['seq_length']}"


def _remedies(cfg: Mapping, estimate: MemoryEstimate, device: str) -> str:
    """What to change, the largest share of the estimate first."""
    shard = (
        "more processes (data parallelism shards the optimizer states; parallel.tensor_model_parallel_size and "
        "pipeline_model_parallel_size split weights, gradients and activations)"
    )
    tokens = "fewer tokens per micro-batch (dataset.micro_batch_tokens, micro_batch_size, seq_length)"
    states = estimate.weights + estimate.gradients + estimate.optimizer
    out = [shard, tokens] if states >= estimate.activations + estimate.logits else [tokens, shard]
    if device == "cuda" and precision_of(cfg["trainer"], device) == "fp32":
        out.append("trainer.precision=bf16")
    if device != "cuda":
        out.append("a GPU, or a CPU-sized model (model=tiny_gpt, tiny_moe, tiny_mrope)")
    return "; ".join(out)
