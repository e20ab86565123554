#!/usr/bin/env bash
# The four-GPU comparison (benchmarks/results/scale_<gpu>x4_<date>.md): thdpack against the tuned Hugging Face stack
# on one host, phase by phase, each phase one or more benchmarks/scale.py sweeps. Run on the GPU host from the
# repository root, with thdpack's GPU dependencies and liger-kernel installed:
#
#   bash benchmarks/scale_x4.sh smoke smoke-real      # every code path on tiny shapes, then real ones (one GPU)
#   bash benchmarks/scale_x4.sh scaling 8b 8b-long    # then moe ctx: the phases of the report
#
# BUDGET_S bounds the whole call (each sweep gets what is left; with --reuse a later call finishes a cut sweep from
# the runs that ended). Reports land in $RESULTS (default outputs/scale_x4/results); after each phase they and the runs' logs are packed
# into $OUT/scale_x4.tgz when $OUT is set (the device tool brings back a few files). Token budgets follow the
# card's memory: the H200's 141 GB or the H100's 80 GB. Combine the reports with benchmarks/scale_report.py.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
WORK=${WORK:-outputs/scale_x4}
RESULTS=${RESULTS:-$WORK/results}
mkdir -p "$RESULTS"
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)  # MiB
BIG=$((MEM > 100000))
COMMON=(--work "$WORK" --out "$RESULTS" --steps 5 --warmup 2 --timeout 420 --reuse)

DEADLINE=$(($(date +%s) + ${BUDGET_S:-1000000}))  # BUDGET_S: seconds this call may take (a device call's limit)

scale() {  # scale.py with a wall-clock guard: a phase that overruns leaves the others their time
  local limit=$1; shift
  local left=$((DEADLINE - $(date +%s) - 15))
  if [ "$left" -lt 60 ]; then echo "### skipped (${left} s left): scale.py $*"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local log="$WORK/logs/$(date -u +%H%M%S)-$$-$RANDOM.log"
  mkdir -p "$WORK/logs"
  echo "### $(date -u +%T) scale.py $* (log $log)"
  timeout --kill-after=20 "$limit" python3 -u benchmarks/scale.py "${COMMON[@]}" "$@" > "$log" 2>&1
  grep -E "^(== |   [0-9]|   transformers|   (out of|failed|skipped))" "$log" | tail -30
}

pack() {
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/scale_x4.tgz.tmp" "$RESULTS" "$WORK/logs" \
    $(find "$WORK/runs" -name '*.log' -o -name '*.result.json' 2>/dev/null) 2>/dev/null
  mv "$OUT/scale_x4.tgz.tmp" "$OUT/scale_x4.tgz"
}

phase_smoke() {  # tiny shapes on every path the phases take: a failure here costs seconds, not a lease
  local w=$((GPUS > 1 ? 2 : 1))
  local layouts=dp+ov,dp+ov+fp8@2048
  [ $w = 2 ] && layouts=$layouts,tp2+ov  # the overlap under TP (stopped there once: an unhooked parameter read)
  scale 240 --shape tiny --world-sizes $w --layouts $layouts --label smoke \
    --hf-configs fsdp2:noreshard:prefetch2,fsdp2:ac:bf16reduce,ddp,ddp:autocast --seq-length 1024 \
    --micro-batch-tokens 4096 --steps 2 --warmup 1
  scale 240 --shape tiny_moe --world-sizes $w --layouts ep$w --hf-configs fsdp2 --label smoke-moe \
    --seq-length 1024 --micro-batch-tokens 4096 --steps 2 --warmup 1
  if [ "$GPUS" -gt 1 ]; then
    scale 240 --shape tiny --world-sizes 2 --layouts cp2:fold+recompute,cp2:distinct+recompute --mix full \
      --seq-length 4096 --micro-batch-tokens 4096 --samples-per-step 1 --hf-samples-per-step 2 \
      --hf-configs fsdp2:ac@4096 --log-te-backend --label smoke-cp --steps 2 --warmup 1
  fi
}

make_dir() {  # the shape's directory where scale.py looks for it, made once before runs that share it start
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from scale_job import \
make_hf_dir; make_hf_dir('$1', 1234, Path('$WORK/models/$1_seed1234'), 'cuda')"
}

phase_smoke-real() {  # one GPU: the real shapes' kernels (Liger, grouped experts, TE) on both sides, ~2 min
  scale 200 --shape llama3_1b --world-sizes 1 --layouts dp+ov@16384,dp+ov+fp8@16384 \
    --hf-configs ddp@16384,fsdp2:noreshard:prefetch2@16384 --steps 3 --warmup 1 --label smoke-1b
  scale 200 --shape qwen3_30b_a3b --layers 2 --world-sizes 1 --layouts ep1+ov@8192 --hf-configs fsdp2@8192 \
    --steps 3 --warmup 1 --label smoke-moe2
}

phase_scaling() {  # the 1B shape, 1 -> 4 GPUs, thdpack data parallel (with and without the overlap) against DDP
  local b=16384
  scale 540 --shape llama3_1b --world-sizes 1,2,4 --layouts dp@$b,dp+ov@$b --hf-configs ddp@$b,ddp:autocast@$b \
    --label 1b-scaling
}

phase_8b() {  # the 8B shape, chat mix: thdpack's layouts against FSDP2's knobs (SIDES: thdpack,hf or one of them)
  if [ $BIG = 1 ]; then
    scale 760 --shape llama3_8b --world-sizes 4 --sides "${SIDES:-thdpack,hf}" \
      --layouts tp2@16384,tp2+ov@16384,tp2+ov+fp8+fuser@16384,tp2+ov+fp8cs@16384,tp4+ov@16384 \
      --hf-configs fsdp2:noreshard@8192,fsdp2:noreshard:prefetch2@8192,fsdp2:ac@16384 --label 8b
  else  # 80 GB: the H200's budgets halved (its fastest peer, noreshard@8192, took 106 GiB); 16,384 tokens only with
    # bf16 gradients (7.5 GiB less) or over TP4 (scale_h100x4_2026-11-27.md: TP2 at 8,192 took 65.3 GiB). FP8:
    # delayed scaling under TP2 was 0.84x bf16 there, while on one H200 it was 1.29x (gpu_checks_h200_2026-12-01.md)
    scale 760 --shape llama3_8b --world-sizes 4 --sides "${SIDES:-thdpack,hf}" \
      --layouts tp2@8192,tp2+ov@8192,tp2+bf16grad@16384,tp4@16384,tp2+fp8+fuser@8192,tp2+fp8cs@8192 \
      --hf-configs fsdp2:noreshard:ac@8192,fsdp2:noreshard:ac:prefetch2@8192,fsdp2:ac@16384 --label 8b
  fi
}

phase_8b-long() {  # the 8B shape, long samples (median 6k tokens, up to 32k), 8 a GPU a step
  local b=$((BIG ? 32768 : 16384))
  scale 300 --shape llama3_8b --world-sizes 4 --mix long --seq-length 32768 --samples-per-gpu 8 \
    --layouts tp2@$b --hf-configs fsdp2:ac@$b,fsdp2:noreshard@$((b / 2)) --label 8b-long --steps 4
}

phase_moe() {  # the Qwen3-30B-A3B shape with 16 of its 48 layers, experts over 4 GPUs
  # 80 GB: both sides ran out of memory at 8,192-token micro-batches (benchmarks/results/scale_h100x4_2026-11-27.md)
  local b=$((BIG ? 8192 : 4096))
  local peers=fsdp2:noreshard@$b,fsdp2@$b
  [ $BIG = 1 ] || peers=fsdp2@$b,fsdp2:ac@$b,fsdp2:noreshard:ac@$b
  local layouts=ep4@$b,ep4+ov@$b
  # 80 GB: also 8,192 tokens with bf16 gradients (the experts' fp32 gradients took 12.5 GiB a GPU)
  [ $BIG = 1 ] || layouts=$layouts,ep4+bf16grad@8192
  scale 720 --shape qwen3_30b_a3b --layers 16 --world-sizes 4 --sides "${SIDES:-thdpack,hf}" \
    --layouts $layouts --hf-configs $peers --label moe
}

phase_ctx() {  # long samples of the 8B: thdpack under context parallelism, transformers one sample a GPU
  # the longest first (the headline's ratio), then the peer's limit, then fold against distinct at 128k and 64k
  local ctx=(--shape llama3_8b --world-sizes 4 --mix full)
  scale 300 "${ctx[@]}" --seq-length 262144 --micro-batch-tokens 262144 --samples-per-step 1 \
    --layouts tp2cp2:fold+recompute --sides thdpack --log-te-backend --label ctx256k-thdpack --steps 2 --warmup 1
  scale 200 "${ctx[@]}" --seq-length 131072 --micro-batch-tokens 131072 --samples-per-step 4 --sides hf \
    --hf-configs fsdp2:ac --label ctx128k-hf --steps 2 --warmup 1
  scale 200 "${ctx[@]}" --seq-length 65536 --micro-batch-tokens 65536 --samples-per-step 4 --sides hf \
    --hf-configs fsdp2:ac --label ctx64k-hf --steps 3 --warmup 1
  scale 300 "${ctx[@]}" --seq-length 131072 --micro-batch-tokens 131072 --samples-per-step 2 \
    --layouts tp2cp2:fold+recompute,tp2cp2:distinct+recompute --sides thdpack --log-te-backend \
    --label ctx128k-thdpack --steps 3 --warmup 1
  scale 240 "${ctx[@]}" --seq-length 65536 --micro-batch-tokens 65536 --samples-per-step 2 \
    --layouts tp2cp2:fold+recompute,tp2cp2:distinct+recompute --sides thdpack --log-te-backend \
    --label ctx64k-thdpack --steps 3 --warmup 1
}

echo "$GPUS GPUs of $MEM MiB; phases: $*"
(while sleep 20; do pack; done) &  # a call cut off at its limit still brings back what finished
packer=$!
for phase in "$@"; do
  echo "=== $(date -u +%T) phase $phase"
  "phase_$phase"
done
kill $packer 2>/dev/null
pack
echo "=== $(date -u +%T) done"
ls "$RESULTS"
