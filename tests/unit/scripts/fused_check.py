"""Compare thdpack.fused.fused_pack with pack_bshd's host path on random batches (run by test_fused.py).

Run in its own process so that TRITON_INTERPRET=1 (set by the caller on a machine without CUDA) is seen
before Triton is first imported. Prints one line per failure and "FUSED OK <n>" at the end.
"""

import sys

import torch

from thdpack import Alignment, find_segments, pack_bshd
from thdpack.fused import fused_pack
from thdpack.layout import plan_layout
from thdpack.pack import _segment_table, _upload_with_boundaries

IGNORE = -100


def random_batch(g: torch.Generator) -> torch.Tensor:
    """[B, S] segment ids: per row, left pad, up to 3 samples (sometimes with gaps), right pad."""
    B = int(torch.randint(1, 5, (), generator=g))
    rows = []
    for _ in range(B):
        row = [0] * int(torch.randint(0, 3, (), generator=g))
        for sample in range(int(torch.randint(0, 4, (), generator=g))):
            if sample and torch.rand((), generator=g) < 0.5:
                row += [0] * int(torch.randint(1, 3, (), generator=g))
            row += [sample + 1] * int(torch.randint(1, 10, (), generator=g))
        rows.append(row + [0] * int(torch.randint(0, 3, (), generator=g)))
    if not any(any(r) for r in rows):
        rows[0].append(1)
    S = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (S - len(r)) for r in rows])


def main(n: int) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    alignments = [
        Alignment(),
        Alignment(cp_size=2),
        Alignment(cp_size=4, mode="fold"),
        Alignment(cp_size=2, tp_size=2, sequence_parallel=True, fp8=True),
    ]
    failures = 0
    for case in range(n):
        ids = random_batch(g)
        alignment = alignments[case % len(alignments)]
        given_labels, with_loss_mask = case % 3 != 0, case % 2 == 0
        dtype = torch.int32 if case % 5 == 0 else torch.int64
        tokens = torch.randint(1, 1000, ids.shape, generator=g).to(dtype)
        batch = {"tokens": tokens, "attention_mask": ids, "source": torch.arange(ids.numel()).view(ids.shape)}
        labels = loss_mask = None
        if given_labels:
            labels = torch.where(torch.rand(ids.shape, generator=g) < 0.2, IGNORE, tokens.roll(-1, 1).long())
            # -1: no target in another convention; both paths keep it and give it no loss
            labels = torch.where(torch.rand(ids.shape, generator=g) < 0.1, -1, labels)
            batch["labels"] = labels
        if with_loss_mask:
            loss_mask = (torch.rand(ids.shape, generator=g) < 0.8).bfloat16()
            batch["loss_mask"] = loss_mask
        expected = pack_bshd(batch, alignment=alignment)

        segments = find_segments(ids)
        layout = plan_layout(segments.length, alignment)
        table = _segment_table(segments, layout, ids.shape[1], labels is None)
        # The table in the buffer the packer uploads: its rows first, the boundary arrays after them.
        buffer, *_ = _upload_with_boundaries([table.rows], layout, torch.device(device))
        on = lambda t: None if t is None else t.to(device)  # noqa: E731
        got = fused_pack(
            on(tokens),
            on(labels),
            on(loss_mask),
            buffer,
            table.rows.shape[1],
            table.total_tokens,
            pad_token_id=0,
            ignore_index=IGNORE,
        )
        names = ["tokens", "labels", "loss_mask", "position_ids", "padding_mask"]
        bad = [
            name
            for name, tensor in zip(names, got, strict=False)
            if tensor.dtype != getattr(expected, name).dtype
            or tensor.shape != getattr(expected, name).shape
            or not torch.equal(tensor.cpu(), getattr(expected, name))
        ]
        real = ~expected.padding_mask
        if not torch.equal(got[5].cpu()[real], expected.extra["source"][real]):
            bad.append("gather")
        if bad:
            failures += 1
            print(
                f"case {case}: {alignment} labels={given_labels} loss_mask={with_loss_mask} {dtype}: {bad}\n{ids}"
            )
    print(f"FUSED {'OK' if not failures else 'FAILED'} {n - failures}/{n}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 60))
