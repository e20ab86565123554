"""The keys of a ``config.json`` as a family reads them, and the one list of keys that cannot change what a model
computes from tokens.

A family's ``model_group`` reads ``config.json`` through a :class:`ConfigReader`, which remembers every key read;
afterwards :meth:`ConfigReader.refuse_unknown` stops at any key that no family read, that is not in
:data:`HARMLESS_KEYS`, and that the recipe does not accept (``model.accept_unknown_config_keys``). So each key of a
checkpoint is mapped to a Megatron setting, checked against the one value thdpack computes, harmless, or accepted
by the user at their own risk; never ignored in silence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .checkpoint import HFCheckpoint, HFConfigError

__all__ = ["ACCEPT_KEY", "HARMLESS_KEYS", "ConfigReader"]

# The recipe key that lets a config.json key through which thdpack does not know.
ACCEPT_KEY = "model.accept_unknown_config_keys"

_TOKEN_ID = "a special token's id, for tokenizers and generation: the model computes the same on any token"
_GENERATION = "a default of transformers' generate(), which no forward pass reads"
_TASK = "metadata of transformers' task heads and pipelines: a causal LM's head is the lm_head tensor"
_OUTPUTS = "which extra outputs transformers returns (or in which container): the logits are the same"
_ENCODER_DECODER = "a setting of encoder-decoder models (is_encoder_decoder: false is required)"

# Keys of config.json that cannot change the logits of a token sequence, each with why (checked against
# transformers 5.24's configuration_utils.py and modeling code: no decoder thdpack imports reads them in its
# forward pass, or what it reads gives the same numbers).
HARMLESS_KEYS: Mapping[str, str] = {
    # who wrote the file
    "_name_or_path": "where transformers loaded the model from",
    "transformers_version": "the transformers version that wrote the file",
    "unsloth_version": "the Unsloth version that wrote the file",
    "_attn_implementation_autoset": "transformers' note that it picked an attention kernel: every kernel "
    "computes the same softmax attention",
    "is_llama_config": "nanotron's note that the config describes a Llama (Hub configs converted from nanotron, "
    "e.g. SmolLM2); transformers never reads it",
    "transformers.js_config": "settings of transformers.js (ONNX dtypes in the browser); transformers never reads "
    "it",
    "tokenizer_class": "which tokenizer class goes with the model: tokens are the data's, not the model's",
    # how the weights were stored or run, not what they compute
    "dtype": "the dtype the file's weights were saved in; trainer.precision decides the compute dtype",
    "torch_dtype": "transformers 4's name of dtype (the dtype the weights were saved in)",
    "use_cache": "generation's key/value cache: a training forward pass computes every position at once",
    "pretraining_tp": "transformers 4 split its MLP matmuls into this many slices when > 1: the same sums",
    "max_position_embeddings": "the longest context the model was trained for: RoPE rotates each position "
    "the same whatever it says (Llama 3 scaling reads its own original_max_position_embeddings)",
    "output_router_logits": "whether transformers returns the router logits (and adds its aux loss to its "
    "own loss): the forward pass is the same (thdpack's aux loss is router_aux_loss_coef)",
    # special tokens
    "bos_token_id": _TOKEN_ID,
    "eos_token_id": _TOKEN_ID,
    "pad_token_id": _TOKEN_ID,
    "unk_token_id": _TOKEN_ID,
    "sep_token_id": _TOKEN_ID,
    "decoder_start_token_id": _TOKEN_ID,
    # generation defaults
    **dict.fromkeys(
        (
            "max_length",
            "min_length",
            "do_sample",
            "early_stopping",
            "num_beams",
            "num_beam_groups",
            "diversity_penalty",
            "temperature",
            "top_k",
            "top_p",
            "typical_p",
            "repetition_penalty",
            "length_penalty",
            "no_repeat_ngram_size",
            "encoder_no_repeat_ngram_size",
            "bad_words_ids",
            "num_return_sequences",
            "output_scores",
            "return_dict_in_generate",
            "forced_bos_token_id",
            "forced_eos_token_id",
            "remove_invalid_values",
            "exponential_decay_length_penalty",
            "suppress_tokens",
            "begin_suppress_tokens",
            "cache_implementation",  # Gemma 3's "hybrid": the key/value cache generate() builds
        ),
        _GENERATION,
    ),  # fmt: skip
    # task heads and output switches
    **dict.fromkeys(
        ("id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "prefix"), _TASK
    ),
    **dict.fromkeys(
        (
            "output_attentions",
            "output_hidden_states",
            "return_dict",
            "torchscript",
            "use_bfloat16",
            "tf_legacy_loss",
        ),
        _OUTPUTS,
    ),
    "chunk_size_feed_forward": "transformers may run a feed-forward layer in chunks of positions: the same "
    "numbers, position by position",
    **dict.fromkeys(("tie_encoder_decoder", "cross_attention_hidden_size", "is_decoder"), _ENCODER_DECODER),
}


class ConfigReader:
    """Reads the keys of one ``config.json`` (``config``: the checkpoint's, or the part of it a family imports as a
    model of its own, e.g. a vision-language checkpoint's language model) and remembers which were read.

    Errors name ``checkpoint``'s file and the line of the key. ``accept``: keys the recipe lets through
    (:data:`ACCEPT_KEY`)."""

    def __init__(
        self, checkpoint: HFCheckpoint, config: Mapping[str, Any] | None = None, accept: Iterable[str] = ()
    ):
        self.checkpoint = checkpoint
        self.config = checkpoint.config if config is None else config
        self.accept = frozenset(accept)
        self.used: set[str] = {"architectures"}  # what chose the family that reads the rest

    def derived(self, config: Mapping[str, Any]) -> ConfigReader:
        """A reader of ``config`` (made from this one's) with this one's file, lines and accepted keys."""
        return ConfigReader(self.checkpoint, config, self.accept)

    def where(self, key: str) -> str:
        return self.checkpoint.where(key)

    def error(self, key: str, message: str) -> HFConfigError:
        return self.checkpoint.error(key, message)

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.config.get(key, default)

    def require(self, key: str, kind: type = int) -> Any:
        """The value of ``key``: a positive int (``kind`` int) or a number (``kind`` float); missing or another
        value stops, naming the key."""
        self.used.add(key)
        if self.config.get(key) is None:
            raise HFConfigError(
                f"{self.checkpoint.path}: key '{key}' is missing: thdpack needs it to build the model"
            )
        value = self.config[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise self.error(key, f"is {value!r}: a positive integer expected")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise self.error(key, f"is {value!r}: a number expected")
        return value

    def unknown(self) -> list[str]:
        """The keys nobody read that are neither harmless nor accepted, sorted."""
        return sorted(set(self.config) - self.used - set(HARMLESS_KEYS) - self.accept)

    def refuse_unknown(self) -> None:
        """Stop at the first key of :meth:`unknown`, naming its line, the others and the way through."""
        unknown = self.unknown()
        if not unknown:
            return
        architecture = (self.config.get("architectures") or ["?"])[0]
        raise self.error(
            unknown[0],
            f"is not known to thdpack's {architecture} import ({len(unknown)} such keys: {unknown}): it may "
            "change what the model computes, so thdpack stops rather than ignore it. If you know it does not, "
            f"{ACCEPT_KEY}=[{','.join(unknown)}] lets it through: the model is then built without it, and "
            "may compute something else than the checkpoint's author meant",
        )
