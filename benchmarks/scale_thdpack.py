"""The thdpack side of ``benchmarks/scale.py``: a worker of ``torchrun ... scale_thdpack.py JOB.json``.

Builds the run from thdpack's recipe (``thdpack.training.loop.setup_run``): the job's Hugging Face directory
imported as a user imports one (``model=hf model.pretrained=DIR``: its config.json builds the model, its weights
are loaded under the job's layout, :mod:`thdpack.hf`), its layout and its samples; then times ``train_step``
over the job's steps, reading the loss and the gradient norm every step as the transformers side does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_job import (  # noqa: E402
    dataset_overrides,
    device_label,
    step_record,
    thdpack_overrides,
    write_worker_result,
)


def overrides(job: dict, device: str) -> list[str]:
    """The recipe of the job's thdpack run: model, data, layout, a constant learning rate (the two sides'
    later
    losses stay comparable), the optimizer settings both sides share, then the job's own overrides."""
    layout = job["layout"]
    return [
        *thdpack_overrides(Path(job["hf_dir"]), device),
        *dataset_overrides(job["dataset"]),
        f"++dataset.mode={layout['mode']}",
        f"parallel.tensor_model_parallel_size={layout['tp']}",
        f"parallel.sequence_parallel={str(layout['tp'] > 1).lower()}",
        f"parallel.pipeline_model_parallel_size={layout['pp']}",
        f"parallel.context_parallel_size={layout['cp']}",
        f"parallel.expert_model_parallel_size={layout['ep']}",
        f"trainer.train_iters={job['steps']}",
        f"trainer.lr={job['lr']}",
        f"trainer.min_lr={job['lr']}",
        "trainer.lr_warmup_iters=0",
        "trainer.lr_decay_style=constant",
        f"trainer.weight_decay={job['weight_decay']}",
        f"trainer.adam_beta1={job['betas'][0]}",
        f"trainer.adam_beta2={job['betas'][1]}",
        f"trainer.clip_grad={job['clip_grad']}",
        f"trainer.seed={job['seed']}",
        "trainer.progress_bar=false",
        *layout.get("overrides", []),
        *job.get("thdpack_overrides", []),
    ]


def main(job_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from megatron.core import parallel_state as ps

    from thdpack.training.loop import recipes_dir, setup_run, train_step

    job = json.loads(job_path.read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides(job, device))
    run = setup_run(cfg)
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    steps = []
    for step in range(1, job["steps"] + 1):
        start = time.perf_counter()
        batches = run.data.next_step()
        losses, outcome = train_step(run, batches)
        # read back every step, as the transformers side does: the benchmark times both sides' steps alike, not
        # the training loop's deferred read of the step's scalars
        loss = run.step.loss.reduce(losses) if last_stage else None
        if device == "cuda":
            torch.cuda.synchronize()
        grad_norm, skipped = float(outcome.grad_norm), bool(outcome.skipped)
        if skipped:
            raise FloatingPointError(
                f"step {step}: the gradient norm is {grad_norm}; the update was held back"
            )
        loss = None if loss is None else float(loss)
        real = sum(int(mb.sum()) for rank in run.data.step_lengths for mb in rank)
        steps.append(step_record(step, time.perf_counter() - start, real, len(batches), loss, grad_norm))
    side = {
        "side": "thdpack",
        "device_name": device_label(),
        "layout": job["layout"]["name"],
        "parallel": {
            "tp": run.config.tensor_model_parallel_size,
            "pp": run.config.pipeline_model_parallel_size,
            "cp": run.config.context_parallel_size,
            "ep": run.config.expert_model_parallel_size,
            "dp": ps.get_data_parallel_world_size(),
            "sequence_parallel": run.config.sequence_parallel,
        },
        "attention_backend": run.runtime.backend,
        "precision": run.runtime.precision,
        "alignment": run.step.batch.alignment.mode,
        "micro_batch_tokens": job["dataset"]["micro_batch_tokens"],
        "overrides": [*job["layout"].get("overrides", []), *job.get("thdpack_overrides", [])],
        "weights": "model=hf model.pretrained (thdpack.hf)",
    }
    write_worker_result(Path(job["out"]), side, steps)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(Path(sys.argv[1]))
