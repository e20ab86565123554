"""L1: ``python -m thdpack.train`` end to end, one short run a recipe family, packed and padded (gloo on CPU, fp32).

The families (tests/functional/training.py): dense single rank, dense TP2 (sequence parallel), dense PP2, MoE
EP2 and MRoPE CP2, each ``trainer.train_iters=6`` on a small corpus. Packed micro-batches hold the same samples as
padded ones (``dataset.micro_batch_tokens=null``), so the two compute the same function of the same real tokens:
their losses and gradient norms must agree per step. Measured on CPU with torch 2.13: equal to the last bit in
most steps, and never more than 2 float32 ulps apart (relative 1.7e-7), because sums run in another order on
another token layout; weights after 6 steps differ by about 1e-7. The tolerance below is 6x that.
"""

import json
import math

import pytest

from .training import FAMILIES, ITERS, family

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

AGREE = dict(rel=1e-6, abs=0)
LOGGED = {"loss", "grad_norm", "lr", "pad_fraction", "real_tokens_per_s", "step_time_s"}
PADDED = [name for name in FAMILIES if name != "mrope_cp2"]  # the padded baseline is not sharded for CP
RUNS = [(name, True) for name in FAMILIES] + [(name, False) for name in PADDED]
BAD_RECIPE = ("trainer.train_iters=6", "trainer.lr_warmup_iters=6")
MISSPELT = ("+trainer.train_itres=5",)


@pytest.fixture(scope="module", autouse=True)
def runs_ahead(trained):
    """Every run of the module, queued in the order its tests ask for them, so that the next one runs beside."""
    in_order = [family(name, packed) for name, packed in RUNS] + [family("mrope_cp2", packed=False)]
    trained.ahead(*in_order, (BAD_RECIPE, 1), (MISSPELT, 1))


def run(trained, name, packed=True):
    overrides, nproc = family(name, packed)
    return trained(*overrides, nproc=nproc)


@pytest.mark.parametrize(
    ("name", "packed"), RUNS, ids=[f"{n}-{'packed' if p else 'padded'}" for n, p in RUNS]
)
def test_every_step_logs_a_finite_loss(trained, name, packed):
    result = run(trained, name, packed).check()
    assert result.steps == list(range(1, ITERS + 1))
    assert all(math.isfinite(loss) for loss in result.losses), result.losses


@pytest.mark.parametrize("name", PADDED)
def test_packing_lowers_the_pad_fraction(trained, name):
    packed = [r["pad_fraction"] for r in run(trained, name, True).check().records]
    padded = [r["pad_fraction"] for r in run(trained, name, False).check().records]
    assert all(p <= q for p, q in zip(packed, padded, strict=True)), (packed, padded)
    assert sum(packed) < sum(padded)


@pytest.mark.parametrize("name", PADDED)
def test_packed_and_padded_losses_agree_per_step(trained, name):
    packed, padded = run(trained, name, True).check(), run(trained, name, False).check()
    assert packed.losses == pytest.approx(padded.losses, **AGREE)


@pytest.mark.parametrize("name", PADDED)
def test_packed_and_padded_gradient_norms_agree_per_step(trained, name):
    packed, padded = run(trained, name, True).check(), run(trained, name, False).check()
    norms = [[r["grad_norm"] for r in result.records] for result in (packed, padded)]
    assert norms[0] == pytest.approx(norms[1], **AGREE)


def test_context_parallel_without_packing_fails_at_start_up(trained):
    result = run(trained, "mrope_cp2", packed=False)
    assert result.returncode != 0
    assert (
        "parallel.context_parallel_size=2 needs dataset.pack_sequences_in_batch=true: the padded BSHD baseline "
        "is not sharded for context parallelism" in result.output
    )
    assert "data: " not in result.output  # stopped before reading any data
    assert not (result.run_dir / "metrics.jsonl").exists()


def test_a_run_writes_metrics_summary_curves_and_tensorboard(trained):
    # python -m thdpack.train model=tiny_gpt trainer.train_iters=6
    result = run(trained, "dense").check()
    assert result.steps == [1, 2, 3, 4, 5, 6]
    assert all(record.keys() >= LOGGED for record in result.records)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["iterations"] == 6
    assert summary["final_loss"] == result.losses[-1]
    assert (result.run_dir / "curves.png").read_bytes().startswith(b"\x89PNG")
    events = list((result.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)


def test_warmup_updates_from_the_first_step_and_each_step_logs_the_rate_it_applied(trained):
    # trainer=default: lr 1e-3 reached over lr_warmup_iters=2: step 1 updates with half of it, step 2 with all
    records = run(trained, "dense").check().records
    assert [r["lr"] for r in records[:2]] == [5e-4, 1e-3]
    assert records[2]["lr"] < 1e-3  # the cosine decay from step 3


def test_the_run_directory_is_printed_at_start_and_end(trained):
    result = run(trained, "dense").check()
    assert result.output.count(f"run directory: {result.run_dir.resolve()}") == 2


def test_a_bad_recipe_fails_fast_with_the_checks_message(trained):
    result = trained(*BAD_RECIPE)
    assert result.returncode == 2  # the message alone, no traceback
    assert (
        "thdpack: trainer.lr_warmup_iters (6) must be below the decay iterations (6: trainer.lr_decay_iters"
        in result.output
    )
    assert "Traceback" not in result.output
    assert "data: " not in result.output
    assert not (result.run_dir / "metrics.jsonl").exists()


def test_a_misspelt_key_stops_the_run_naming_the_closest_key(trained):
    # Hydra refuses trainer.train_itres=5 and suggests the +: the run would then train the default 20 iterations
    result = trained(*MISSPELT)
    assert result.returncode != 0
    assert "trainer.train_itres is not a recipe key: did you mean trainer.train_iters?" in result.output
    assert not (result.run_dir / "metrics.jsonl").exists()
