"""A tiny Hugging Face model directory to try fine-tuning with, made here: no download.

    python tests/make_tiny_hf.py /tmp/tiny-qwen3                      # Qwen3, its chat template
    python tests/make_tiny_hf.py /tmp/tiny-llama --family llama3      # Llama 3.x with llama3 RoPE scaling
    python tests/make_tiny_hf.py /tmp/tiny-vl --family qwen2_5_vl     # or qwen3_vl, qwen3_vl_moe: with images

transformers builds the model from a config (2 layers, hidden 64, random weights) and saves it with
``save_pretrained`` (config.json, model.safetensors); the tokenizer is a small BPE trained on the standard
library's text with the family's real chat template and special tokens (:mod:`tests.hf_tokenizers`). A
vision-language family adds a small vision tower and the image processor's ``preprocessor_config.json`` (PIL:
no torchvision needed; :mod:`tests.vlm_models`). The directory is what ``model=hf model.pretrained=DIR`` takes,
as a released checkpoint would be.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hf_models import build  # noqa: E402
from tests.hf_tokenizers import write_tokenizer  # noqa: E402
from tests.vlm_models import build_tiny_vl  # noqa: E402

STYLES = {"qwen3": "qwen3", "qwen2": "qwen2_5", "llama3": "llama3"}
VISION_LANGUAGE = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def make(directory: Path, family: str = "qwen3", seed: int = 0) -> Path:
    """Write the tokenizer, then a ``family`` model whose vocabulary holds it (rounded up to 64, as released
    checkpoints round theirs); returns ``directory``."""
    if family in VISION_LANGUAGE:
        # transformers' own initialisation (sharp=False): a model to train, not a parity probe
        return build_tiny_vl(directory, seed=seed, sharp=False, family=family)
    info = write_tokenizer(directory, STYLES[family])
    vocab = -(-info.vocab_size // 64) * 64
    ids = {"bos_token_id": info.bos_id, "eos_token_id": info.eos_id, "pad_token_id": info.pad_id}
    model = build(family, seed, vocab_size=vocab, **{k: v for k, v in ids.items() if v is not None})
    model.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--family", choices=[*sorted(STYLES), *VISION_LANGUAGE], default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make(args.directory, args.family, args.seed))


if __name__ == "__main__":
    main()
