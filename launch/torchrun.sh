#!/usr/bin/env bash
# One node, any number of GPUs (or CPU processes over gloo):
#
#   bash launch/torchrun.sh [NPROC] [recipe overrides...]
#   bash launch/torchrun.sh 8 model=llama3_1b parallel=tp2 trainer.train_iters=1000 checkpoint.dir=ckpt/llama
#
# NPROC defaults to the number of visible GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi), or 1 without a GPU.
# Every rank writes to one run directory: outputs/$THDPACK_RUN_STAMP (a time stamp unless set), or the
# hydra.run.dir=... given among the overrides; torchrun's per-rank logs go to its logs/ folder.
# Environment: PYTHON (python), OMP_NUM_THREADS (cores / NPROC), THDPACK_RUN_STAMP. Exits with torchrun's code,
# or 2 when the recipe cannot run (its message printed once, by rank 0).
# kill -TERM / -USR1 / -INT <this script's pid> (or Ctrl-C): every rank saves after its current step and exits 0.
set -euo pipefail

visible_gpus() {
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then  # set and empty = no GPU
        [[ -z $CUDA_VISIBLE_DEVICES ]] && echo 0 || awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    NPROC=$1
    shift
else
    NPROC=$(visible_gpus)
    ((NPROC > 0)) || NPROC=1
fi

PYTHON=${PYTHON:-python}
export THDPACK_RUN_STAMP=${THDPACK_RUN_STAMP:-$(date +%Y-%m-%d_%H-%M-%S)}
RUN_DIR=outputs/$THDPACK_RUN_STAMP  # the recipe's hydra.run.dir, unless an override names another
for arg in "$@"; do
    [[ $arg == hydra.run.dir=* ]] && RUN_DIR=${arg#hydra.run.dir=}
done
# torch's own default is 1 thread per process; a CPU run is faster with the cores shared out
threads=$(($(nproc) / NPROC))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}

# A recipe that cannot run exits with code 2 on its ranks, after rank 0 printed the message; torchrun then adds
# its ChildFailedError traceback, which says nothing more. torchrun's stderr goes through this filter: its report
# of a failure where every rank exited 2 (or was ended by torchrun, -15, after one did) is dropped (the filter exits
# 3, the script 2); any other is printed.
# The ranks' own lines come prefixed ([default0]:...), so only torchrun's unprefixed traceback is held back.
FILTER='
    !held && /^Traceback \(most recent call last\):/ { held = 1 }
    held { buffer = buffer $0 "\n"; if ($0 ~ /exitcode *: 2 /) two++; else if ($0 ~ /exitcode *: -15 /) killed++; else if ($0 ~ /exitcode *: /) other++; next }
    / failed \(exitcode: 2\) local_rank: | closing signal SIGTERM$/ { next }
    { print; fflush() }
    END { if (held && two && !other && buffer ~ /ChildFailedError/) exit 3; printf "%s", buffer }'

echo "thdpack: $NPROC process(es) on $(hostname), run directory $RUN_DIR, rank logs in $RUN_DIR/logs" >&2
fifo=$(mktemp -u "${TMPDIR:-/tmp}/thdpack-torchrun.XXXXXX")
mkfifo "$fifo"
trap 'rm -f "$fifo"' EXIT
(trap '' INT TERM USR1; exec awk "$FILTER" <"$fifo" >&2) &
filter=$!
# Signals: SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) sent to this script reach every rank once, through this script: each
# saves a checkpoint after its current step and exits 0 (a second SIGINT stops them at once). torchrun ignores them
# (it would end its ranks without a save, or die of SIGUSR1 and leave them training) and runs in a process group
# of its own, so that Ctrl-C does not reach the ranks a second time. torchrun dies with this script (setpriv
# --pdeathsig, where util-linux has it), the ranks with torchrun (after a save), their checkpoint writers with them.
# torchrun's --signals-to-handle (read from PET_SIGNALS_TO_HANDLE; TORCHELASTIC_... where the option is missing)
export PET_SIGNALS_TO_HANDLE=SIGHUP,SIGQUIT TORCHELASTIC_SIGNALS_TO_HANDLE=SIGHUP,SIGQUIT
die_with_script=()
setpriv --help 2>/dev/null | grep -q -- --pdeathsig && die_with_script=(setpriv --pdeathsig KILL)
set -m  # the next job in a process group of its own
(
    trap '' TERM INT USR1
    exec "${die_with_script[@]}" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
        --log-dir "$RUN_DIR/logs" --tee 3 \
        -m thdpack.train "$@" 2>"$fifo"
) &
agent=$!
set +m
forward() { pkill "-$1" -P "$agent" 2>/dev/null || true; }  # torchrun's children: the ranks
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward USR1' USR1
while :; do
    rc=0
    wait "$agent" || rc=$?
    ((rc > 128)) && kill -0 "$agent" 2>/dev/null || break  # a wait cut short by a signal
done
filtered=0
wait "$filter" || filtered=$?
((filtered == 3)) && exit 2
exit "$rc"
