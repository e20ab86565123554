"""Model families: one module per architecture behind one declared form (:class:`ModelFamily`), one registry.

``gpt`` builds a model from the recipe alone; the others import a Hugging Face checkpoint (``model=hf
model.pretrained=DIR``, found by ``config.json``'s ``architectures``): ``llama``, ``mistral``, ``qwen2``,
``qwen3``, ``qwen3_moe``, ``gemma3``, ``gpt_oss`` (:mod:`thdpack.models.decoder`: Megatron's ``GPTModel``) and
``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe`` (:mod:`thdpack.models.vl`). A new family is a new module declaring ``FAMILY``.
"""

from .family import COMMON_MODEL_KEYS, ModelFamily, ModelGroup
from .pretrained import model_group, pretrained_model_group
from .registry import family_of, get_family, known_architectures, register_family

__all__ = [
    "COMMON_MODEL_KEYS",
    "ModelFamily",
    "ModelGroup",
    "family_of",
    "get_family",
    "known_architectures",
    "model_group",
    "pretrained_model_group",
    "register_family",
]
