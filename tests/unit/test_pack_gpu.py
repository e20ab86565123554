"""The packer on a GPU-resident batch: same result as on the host, and no host-device sync."""

import pytest
import torch

from thdpack import Alignment, find_segments, pack_bshd
from thdpack.fused import fused_pack_available

pytestmark = pytest.mark.gpu


def batch(B=6, S=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    mask = torch.arange(S)[None] < lengths[:, None]
    tokens = torch.randint(1, 1000, (B, S), generator=g) * mask
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": mask.float(), "attention_mask": mask}


ALIGNMENTS = [
    Alignment(),
    Alignment(cp_size=2),
    Alignment(cp_size=2, mode="fold"),
    Alignment(cp_size=2, tp_size=2, sequence_parallel=True, pad_total_to=256),
]


@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("given_labels", [True, False])
@pytest.mark.parametrize("path", ["fused", "torch"])
def test_packing_a_gpu_batch_with_host_segments_makes_no_sync(alignment, given_labels, path, monkeypatch):
    # "torch": the path without the Triton kernel (Triton missing, unusual dtypes, or THDPACK_FUSED=0).
    if path == "fused":
        pytest.importorskip("triton", reason="the fused path needs Triton")
    monkeypatch.setenv("THDPACK_FUSED", "1" if path == "fused" else "0")
    host = batch()
    host["weights"] = torch.rand(host["tokens"].shape).bfloat16()  # an extra key, a dtype numpy lacks
    # MRoPE ids are gathered with the kernel's source map.
    host["mrope_position_ids"] = torch.randint(0, 50, (3, *host["tokens"].shape))
    if not given_labels:
        del host["labels"]
    segments = find_segments(host["attention_mask"])
    gpu = {k: v.cuda() for k, v in host.items() if k != "attention_mask"}
    # The path under test is the one pack_bshd takes (not the other one, silently).
    assert fused_pack_available(gpu["tokens"], gpu.get("labels"), gpu["loss_mask"]) == (path == "fused")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = pack_bshd(gpu, segments=segments, alignment=alignment)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = pack_bshd(host, alignment=alignment)
    for name, t in expected.token_tensors().items():
        assert torch.equal(packed.token_tensors()[name].cpu(), t), name
    assert torch.equal(packed.cu_seqlens.cpu(), expected.cu_seqlens)
    assert (packed.cu_seqlens is packed.cu_seqlens_padded) == (
        expected.cu_seqlens is expected.cu_seqlens_padded
    )


def test_find_segments_on_a_gpu_mask_matches_the_host():
    host = batch()["attention_mask"]
    a, b = find_segments(host), find_segments(host.cuda())
    assert torch.equal(a.row, b.row) and torch.equal(a.start, b.start) and torch.equal(a.length, b.length)


@pytest.mark.parametrize("restart", [False, True])
def test_host_mask_with_gpu_position_ids_matches_the_host(restart):
    # A host mask with position ids on the GPU: the restart check brings only the columns it reads to the host,
    # and the samples are those of the all-host call (with restarts: HF-flattening style, split at zeros).
    mask = batch()["attention_mask"]
    positions = torch.arange(mask.shape[1]).expand_as(mask).clone()
    if restart:
        positions[:, 7:] -= 7  # a second sample starts at column 7 of every row long enough
    a = find_segments(mask, position_ids=positions)
    b = find_segments(mask, position_ids=positions.cuda())
    assert torch.equal(a.row, b.row) and torch.equal(a.start, b.start) and torch.equal(a.length, b.length)
    assert (len(a) > mask.shape[0]) == restart
