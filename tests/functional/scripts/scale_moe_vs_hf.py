"""One process (gloo, fp32): the tiny Qwen3-MoE shape as thdpack builds it from a Hugging Face directory
(``benchmarks/scale_job.py`` recipe overrides, ``benchmarks/scale_weights.py`` by-name copy) against
transformers' own model of the same directory: the logits of one row of random tokens. Prints one JSON
line."""

import json
import sys
import tempfile
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH))

from scale_job import dataset_config, make_hf_dir  # noqa: E402
from scale_thdpack import overrides  # noqa: E402
from scale_weights import load_hf_weights  # noqa: E402


def main() -> None:
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForCausalLM

    from thdpack.megatron.unwrap import unwrap_model
    from thdpack.training.loop import recipes_dir, setup_run

    hf_dir = make_hf_dir("tiny_moe", 1234, Path(tempfile.mkdtemp()) / "tiny_moe")
    job = {
        "hf_dir": str(hf_dir),
        "layout": {"name": "dp", "tp": 1, "pp": 1, "cp": 1, "ep": 1, "mode": "auto"},
        "dataset": dataset_config(seq_length=64, global_batch_size=1, micro_batch_tokens=64, mix="chat"),
        "steps": 1,
        "lr": 1e-5,
        "weight_decay": 0.01,
        "betas": [0.9, 0.95],
        "clip_grad": 1.0,
        "seed": 1234,
    }
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides(job, "cpu"))
    model = unwrap_model(setup_run(cfg).model)
    load_hf_weights(model, hf_dir)
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    tokens = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32)[None]
    with torch.no_grad():
        ours = model(tokens, positions, None)
        theirs = reference(input_ids=tokens, position_ids=positions, use_cache=False).logits
    diff = (ours - theirs).abs().max().item()
    print(json.dumps({"max_abs_diff": diff, "max_abs_logit": theirs.abs().max().item()}))


if __name__ == "__main__":
    main()
