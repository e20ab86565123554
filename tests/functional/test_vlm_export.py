"""L1: ``python -m thdpack.train model=hf model.pretrained=<a Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE directory>
dataset=embedded_vlm checkpoint.dir=CKPT`` (two steps, vision tower frozen), then ``python -m thdpack.export CKPT
OUT``: transformers loads OUT with no missing or unexpected key, under the source's names (Qwen3-VL-MoE: its fused
experts in the source's orientation, transformers 5.x's or the released checkpoints'); its logits on a text-only, a
one-image and a two-image sample equal those of thdpack's model loaded from the checkpoint by megatron-core itself; a
Qwen3-VL run under TP2 and a Qwen3-VL-MoE run under EP2 export what the one-rank run exports."""

from __future__ import annotations

import json

import pytest
import torch

from tests.vlm_models import build_tiny_vl, released_orientation

from .training import export_runs, finish, start_train, tail

pytestmark = [
    pytest.mark.functional,
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

SEQ = 512
VL = (
    "dataset=embedded_vlm",
    "dataset.vlm.num_samples=16",
    "dataset.vlm.max_side=112",
    f"dataset.seq_length={SEQ}",
    "dataset.global_batch_size=4",
    "trainer.seed=1234",
    "trainer.train_iters=2",
    "trainer.lr_warmup_iters=0",
)


NAMES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_moe_released"]
# the runs besides one rank's: a layout of one family each (TP2: DeepStack, q/k norms; EP2: the MoE family)
PARALLEL = {
    "qwen3_vl tp2": ("qwen3_vl", "parallel=tp2"),
    "qwen3_vl_moe ep2": ("qwen3_vl_moe", "parallel=ep2"),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple]:
    """``key -> (source dir, root, run, export)`` of every two-step run of the module (its checkpoint in
    ``root / "ckpt"``) and its export (to ``root / "out"``; None after a failed run): one rank on each of NAMES (``qwen3_vl_moe_released``: the source's fused experts in the
    released checkpoints' orientation, ``[E, H, 2I]``, ``[E, I, H]``) and the PARALLEL runs. The runs start
    together, then the exports together: independent processes, and one process alone leaves a core of two idle."""
    sources, roots, started = {}, {}, {}
    for name in NAMES:
        roots[name] = tmp_path_factory.mktemp(name)
        sources[name] = build_tiny_vl(roots[name] / "source", family=name.removesuffix("_released"))
        if name.endswith("_released"):
            sources[name] = released_orientation(sources[name], roots[name] / "released")
    for key, (name, _) in PARALLEL.items():
        roots[key], sources[key] = tmp_path_factory.mktemp(key.replace(" ", "_")), sources[name]
    for key, root in roots.items():
        layout = PARALLEL[key][1:] if key in PARALLEL else ()
        command = [
            "model=hf",
            f"model.pretrained={sources[key]}",
            *VL,
            f"checkpoint.dir={root / 'ckpt'}",
            *layout,
        ]
        started[key] = start_train(command, root / "run", nproc=2 if layout else 1)
    trained = {key: finish(run, timeout=300) for key, run in started.items()}
    done = export_runs(trained, roots)
    return {key: (sources[key], roots[key], trained[key], done.get(key)) for key in roots}


def exported(exports, key: str):
    """``(source dir, checkpoint dir, exported dir)`` of ``key``'s run; fails the test if it or its export failed."""
    source, root, run, export = exports[key]
    run.check()
    if export.returncode:
        pytest.fail(f"python -m thdpack.export exited with {export.returncode}\n{tail(export.output)}")
    return source, root / "ckpt", root / "out"


def model_type(directory) -> str:
    return json.loads((directory / "config.json").read_text())["model_type"]


def tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("model*.safetensors")):
        out |= load_file(str(file))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_transformers_loads_the_export_under_the_sources_names_with_trained_text_and_the_frozen_tower(
    exports, name
):
    from transformers import AutoModelForImageTextToText

    source, _, out = exported(exports, name)
    _, info = AutoModelForImageTextToText.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info
    before, after = tensors(source), tensors(out)
    assert sorted(after) == sorted(before)
    assert {n: (t.dtype, t.shape) for n, t in after.items()} == {
        n: (t.dtype, t.shape) for n, t in before.items()
    }
    vision = [n for n in before if n.startswith(("visual.", "model.visual."))]
    assert vision and all(torch.equal(before[n], after[n]) for n in vision)  # frozen: bit for bit
    moved = {n: float((after[n] - before[n]).abs().max()) for n in before if n not in vision}
    print(f"text tensors moved by training: {sum(v > 0 for v in moved.values())} of {len(moved)}")
    assert all(v > 0 for v in moved.values()), [n for n, v in moved.items() if v == 0]
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from thdpack.megatron import cpu

    assert not dist.is_initialized() and not ps.model_parallel_is_initialized(), "a process group leaked"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    cpu.initialize_model_parallel_cpu(seed=1234)
    yield
    cpu.destroy_model_parallel_cpu()


def logit_difference(source, ckpt, out) -> tuple[float, float, float]:
    """``(max |logit difference|, thdpack's loss, transformers')`` on the mixed chats: transformers on the export
    ``out`` against thdpack's model holding the checkpoint ``ckpt`` as megatron-core itself loads it (independent of
    the export)."""
    from megatron.core import dist_checkpointing

    from tests.vlm_parity import (
        build,
        hf_reference,
        max_logit_difference,
        mixed_chats,
        model_group,
        samples,
        thdpack_forward,
    )
    from thdpack.hf.processor import VLProcessor

    group = model_group(source, SEQ)
    parallel = dict.fromkeys(
        (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ),
        1,
    )
    model, _ = build(source, group, parallel, SEQ)  # the source's weights, replaced by the checkpoint's
    # megatron-core's own load (resharded from the run's layout): the trained weights, independent of the export
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt / "iter_0000002"))
    model.load_state_dict(loaded["model"])
    batch = samples(VLProcessor(out), mixed_chats())
    logits, where, loss_sum, count = thdpack_forward(model, batch, SEQ)
    reference = hf_reference(out, batch)
    untrained = hf_reference(source, batch)
    assert abs(untrained.loss_sum - reference.loss_sum) > 1e-4  # the checkpoint is the trained model
    difference = max_logit_difference(reference, logits, where)
    return difference, loss_sum / count, reference.loss_sum / reference.loss_count


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("name", NAMES)
def test_transformers_logits_of_the_export_equal_thdpacks_of_the_checkpoint(exports, name):
    difference, loss, reference = logit_difference(*exported(exports, name))
    print(f"max |logit difference| {difference:.3g}; loss thdpack {loss:.8f} transformers {reference:.8f}")
    assert difference <= 1e-4
    assert loss == pytest.approx(reference, abs=1e-4)


def test_a_tp2_run_exports_what_the_one_rank_run_exports(exports):
    source, _, out = exported(exports, "qwen3_vl")
    _, _, tp2 = exported(exports, "qwen3_vl tp2")
    one, two, before = tensors(out), tensors(tp2), tensors(source)
    assert sorted(two) == sorted(one)
    assert {n: t.dtype for n, t in two.items()} == {n: t.dtype for n, t in one.items()}
    difference = {n: float((two[n] - one[n]).abs().max()) for n in one}
    moved = {n: float((one[n] - before[n]).abs().max()) for n in one}
    worst = max(difference, key=difference.get)
    print(f"TP2 against one rank: max |difference| {difference[worst]:.3g} ({worst}); training moved the text "
          f"tensors by up to {max(moved.values()):.3g}")  # fmt: skip
    vision = [n for n in one if n.startswith("model.visual.")]
    assert vision and [n for n in vision if not torch.equal(one[n], two[n])] == []
    # Adam turns the last bits of TP2's gradient sums into ~1e-5 here; a misplaced shard would be ~1e-1.
    assert difference[worst] <= 5e-5


@pytest.mark.usefixtures("one_rank")
def test_an_ep2_run_exports_what_the_one_rank_run_exports_and_its_logits_equal_thdpacks(exports):
    """Half the experts on each of two ranks: the export puts every expert back in its place in the fused tensors
    (a misplaced expert would differ by the training's whole movement, not by rounding)."""
    from transformers import AutoModelForImageTextToText

    source, _, out = exported(exports, "qwen3_vl_moe")
    _, ckpt, ep2 = exported(exports, "qwen3_vl_moe ep2")
    _, info = AutoModelForImageTextToText.from_pretrained(str(ep2), output_loading_info=True)
    assert not any(info.values()), info
    one, two, before = tensors(out), tensors(ep2), tensors(source)
    assert sorted(two) == sorted(one)
    assert {n: t.dtype for n, t in two.items()} == {n: t.dtype for n, t in one.items()}
    difference = {n: float((two[n] - one[n]).abs().max()) for n in one}
    moved = {n: float((one[n] - before[n]).abs().max()) for n in one}
    worst = max(difference, key=difference.get)
    fused = max(moved[n] for n in one if n.endswith("experts.gate_up_proj"))
    print(f"EP2 against one rank: max |difference| {difference[worst]:.3g} ({worst}); training moved the fused "
          f"experts by up to {fused:.3g}")  # fmt: skip
    assert difference[worst] <= 5e-5
    logits, loss, reference = logit_difference(source, ckpt, ep2)
    print(f"EP2: max |logit difference| {logits:.3g}; loss thdpack {loss:.8f} transformers {reference:.8f}")
    assert logits <= 1e-4
