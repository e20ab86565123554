"""The packer's torch path (the device twins of the numpy host path): same result as the host path, and on a GPU
no host-device sync. Training packs on the host (``get_batch``); this path serves a batch that is already on a
device. Every test runs on CPU tensors routed through the torch path, and on CUDA when a GPU is there."""

import contextlib

import pytest
import torch

from thdpack import Alignment, find_segments, from_packed_batch, pack_bshd
from thdpack.packing import paths

from ..helpers import count_syncs, segments_or_error


class Device:
    """Where a test's batch lives, and how to make the packer take its torch path there."""

    def __init__(self, name: str, monkeypatch):
        self.name, self.cuda, self._monkeypatch = name, name == "cuda", monkeypatch

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.name)

    @contextlib.contextmanager
    def twins(self):
        """The torch path: on CUDA by itself; on CPU tensors, with the host path switched off."""
        with self._monkeypatch.context() as m:
            if not self.cuda:
                m.setattr(paths, "numpy_path", lambda t: False)
            yield

    @contextlib.contextmanager
    def no_sync(self):
        """On CUDA: any host-device sync raises (on CPU there is none to catch)."""
        if not self.cuda:
            yield
            return
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
)


@pytest.fixture(params=["cpu", CUDA])
def device(request, monkeypatch):
    return Device(request.param, monkeypatch)


def batch(B=6, S=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    mask = torch.arange(S)[None] < lengths[:, None]
    tokens = torch.randint(1, 1000, (B, S), generator=g) * mask
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": mask.float(), "attention_mask": mask}


def assert_same_token_tensors(packed, expected):
    """Every token-aligned tensor of ``packed`` (from the torch path) equals the host path's."""
    for name, t in expected.token_tensors().items():
        assert torch.equal(packed.token_tensors()[name].cpu(), t), name


ALIGNMENTS = [
    Alignment(),
    Alignment(cp_size=2),
    Alignment(cp_size=2, mode="fold"),
    Alignment(cp_size=2, tp_size=2, sequence_parallel=True, pad_total_to=256),
]


@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("given_labels", [True, False])
def test_packing_a_device_batch_with_host_segments_matches_the_host_without_sync(
    device, alignment, given_labels
):
    host = batch()
    host["weights"] = torch.rand(host["tokens"].shape).bfloat16()  # an extra key, a dtype numpy lacks
    # MRoPE ids are gathered with the same source map as the tokens.
    host["mrope_position_ids"] = torch.randint(0, 50, (3, *host["tokens"].shape))
    if not given_labels:
        del host["labels"]
    segments = find_segments(host["attention_mask"])
    on_device = {k: device.put(v) for k, v in host.items() if k != "attention_mask"}
    with device.twins(), device.no_sync():
        packed = pack_bshd(on_device, segments=segments, alignment=alignment)
    expected = pack_bshd(host, alignment=alignment)
    assert_same_token_tensors(packed, expected)
    assert torch.equal(packed.cu_seqlens.cpu(), expected.cu_seqlens)
    assert (packed.cu_seqlens is packed.cu_seqlens_padded) == (
        expected.cu_seqlens is expected.cu_seqlens_padded
    )


def device_masks():
    """(name, host mask): 0/1 masks of several dtypes and paddings, segment ids and bad values."""
    mask = batch()["attention_mask"]
    hole = mask.clone()
    hole[2] = True
    hole[2, 1] = False
    yield "bool right", mask
    yield "int64 left", mask.flip(1).long()
    yield "float32", mask.float()
    yield "bfloat16", mask.bfloat16()
    yield "segment ids", mask.long() * torch.where(torch.arange(mask.shape[1]) < 9, 1, 2)
    yield "hole", hole.int()
    yield "negative", mask.long() - 2 * (torch.arange(mask.shape[1]) == 3)
    yield "fractional", mask.float() / 2


@pytest.mark.parametrize("name,mask", list(device_masks()), ids=[name for name, _ in device_masks()])
def test_find_segments_on_a_device_mask_matches_the_host_with_one_copy(device, name, mask):
    expected = segments_or_error(mask)
    on_device = device.put(mask)
    with device.twins():
        # Same samples, or the same error, as on the host.
        assert segments_or_error(on_device) == expected
        if device.cuda and name in ("bool right", "int64 left", "float32", "bfloat16"):
            # A 0/1 mask: one device-to-host copy (the per-row table), nothing else.
            assert count_syncs(lambda: find_segments(on_device)) == 1


@pytest.mark.parametrize("B,S", [(2, 300_000), (20_000, 12)], ids=["wide", "tall"])
def test_wide_and_tall_batches_match_the_host(device, B, S):
    # Very wide and very tall batches: the device reductions and gathers at sizes beyond training's.
    host = batch(B, S, seed=3)
    mask = host["attention_mask"]
    expected = pack_bshd(host)
    # A hole, and segment ids (two samples in each row long enough): the same error and samples as on the host.
    row = B - 1 - int((mask.sum(1) >= 3).flip(0).int().argmax())  # the last row long enough
    hole = mask.clone()
    hole[row, 1] = False
    ids = mask.long() * torch.where(torch.arange(S) < 2, 1, 2)
    expected_errors = [segments_or_error(m) for m in (hole, ids)]
    segments = find_segments(mask)
    on_device = {k: device.put(v) for k, v in host.items()}
    with device.twins():
        assert_same_token_tensors(pack_bshd(on_device), expected)  # the mask on the device too
        nomask = {k: v for k, v in on_device.items() if k != "attention_mask"}
        assert_same_token_tensors(pack_bshd(nomask, segments=segments), expected)
        for m, error in zip((hole, ids), expected_errors, strict=True):
            assert segments_or_error(device.put(m)) == error


@pytest.mark.parametrize("restart", [False, True])
def test_host_mask_with_device_position_ids_matches_the_host(device, restart):
    # A host mask with position ids on the device: the restart check brings only the columns it reads to the
    # host, and the samples are those of the all-host call (with restarts: HF-flattening style, split at zeros).
    mask = batch()["attention_mask"]
    positions = torch.arange(mask.shape[1]).expand_as(mask).clone()
    if restart:
        positions[:, 7:] -= 7  # a second sample starts at column 7 of every row long enough
    a = find_segments(mask, position_ids=positions)
    b = find_segments(mask, position_ids=device.put(positions))
    assert torch.equal(a.row, b.row) and torch.equal(a.start, b.start) and torch.equal(a.length, b.length)
    assert (len(a) > mask.shape[0]) == restart


def test_adopting_a_packed_device_batch_matches_the_host_without_sync(device):
    # A Megatron-Bridge / NeMo packed batch: token tensors on the device, boundary arrays (with -1 sentinels and
    # argmin) on the host as the loader delivers them. Bridge's get_packed_seq_params reads argmin with .item().
    host = {
        "tokens": torch.tensor([[11, 12, 13, 0, 21, 22, 0, 0, 31, 0]]),
        "labels": torch.tensor([[12, 13, 14, 0, 22, 23, 0, 0, 32, 0]]),
        "loss_mask": torch.tensor([[1.0, 1, 1, 0, 1, 1, 0, 0, 1, 0]]),
        "cu_seqlens": torch.tensor([[0, 4, 8, 10, -1]], dtype=torch.int32),
        "cu_seqlens_unpadded": torch.tensor([[0, 3, 5, 6, -1]], dtype=torch.int32),
        "cu_seqlens_argmin": torch.tensor([[4]]),
        "max_seqlen": torch.tensor([[4]], dtype=torch.int32),
    }
    token_keys = ("tokens", "labels", "loss_mask")
    on_device = {k: device.put(v) if k in token_keys else v for k, v in host.items()}
    with device.twins(), device.no_sync():
        packed = from_packed_batch(on_device)
    expected = from_packed_batch(host)
    assert_same_token_tensors(packed, expected)
    assert torch.equal(packed.cu_seqlens.cpu(), expected.cu_seqlens)
    assert torch.equal(packed.cu_seqlens_padded.cpu(), expected.cu_seqlens_padded)
    assert packed.max_seqlen == expected.max_seqlen == 4


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_batch_on_another_gpu_than_the_current_one_is_packed_there():
    host = batch()
    segments = find_segments(host["attention_mask"])
    other = torch.device("cuda", 1)
    gpu = {k: v.to(other) for k, v in host.items()}
    assert torch.cuda.current_device() == 0
    packed = pack_bshd(gpu, segments=segments)
    expected = pack_bshd(host)
    assert packed.tokens.device == other
    assert_same_token_tensors(packed, expected)
    assert segments_or_error(gpu["attention_mask"]) == segments_or_error(host["attention_mask"])


def test_negative_labels_are_no_target_on_a_device_batch(device):
    # A label of -1 (another convention's "no target") stays as given and counts no loss, as on the host.
    host = batch()
    host["labels"][:, ::3] = -1
    segments = find_segments(host["attention_mask"])
    expected = pack_bshd(host)
    on_device = {k: device.put(v) for k, v in host.items() if k != "attention_mask"}
    with device.twins():
        assert_same_token_tensors(pack_bshd(on_device, segments=segments), expected)


def test_adopting_bridges_current_offline_form_on_a_device_matches_the_host_without_sync(device):
    # src/megatron/bridge/data/packing/gpt_sft.py without pad_seq_to_mult: the fill [8, 10) is a slot of
    # cu_seqlens_q that padding_mask (host) marks as pad; token tensors on the device.
    pad = torch.tensor([[False] * 8 + [True] * 2])
    host = {
        "tokens": torch.tensor([[11, 12, 13, 21, 22, 31, 32, 33, 2, 2]]),
        "labels": torch.tensor([[12, 13, 2, 22, 2, 32, 33, 2, 2, 2]]),
        "loss_mask": torch.tensor([[1.0, 1, 1, 1, 1, 0, 1, 1, 0, 0]]),
        "padding_mask": pad,
        "cu_seqlens_q": torch.tensor([[0, 3, 5, 8, 10]], dtype=torch.int32),
        "max_seqlen_q": torch.tensor([[3]], dtype=torch.int32),
    }
    on_device = {k: device.put(v) if k in ("tokens", "labels", "loss_mask") else v for k, v in host.items()}
    with device.twins(), device.no_sync():
        packed = from_packed_batch(on_device)
    expected = from_packed_batch(host)
    assert_same_token_tensors(packed, expected)
    assert expected.labels.tolist() == [[12, 13, 2, 22, 2, 32, 33, 2, -100, -100]]
    assert torch.equal(packed.padding_mask.cpu(), pad)
