#!/usr/bin/env bash
# Run every data-parallel method of the cookbook on the same recipe and compare them.
#
#   bash start.sh                         # every method this machine can run, demo data, 4 epochs
#   bash start.sh --methods ddp,spawn     # a subset (dp ddp launch spawn amp horovod slurm fsdp deepspeed)
#   bash start.sh --data /data/imagenet --epochs 90 -- -a resnet50 -j 8   # args after -- go to every trainer
#   bash start.sh --dummy                 # synthetic images
#   bash start.sh --benchmark             # images/s of each method against a bare DDP loop and
#                                         # against the ceiling: N replicas with no communication
#   bash start.sh --profile 3:6           # also profile steps 3..6 of each method: trace-rank<R>.json in its
#                                         # checkpoint directory, split by tools/profile_split.py into
#                                         # logs/<method>.profile.jsonl, its exposed-communication share in the table
#   bash start.sh --dry-run               # print the commands only
#
# One process per GPU when GPUs are visible, else --nproc CPU processes (default 2). Each method
# logs to logs/<method>.log (benchmark: logs/benchmark/), and checkpoints into logs/checkpoints/<method>/
# (both replaced at each run); statistics.sh turns the logs into a table.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PY=${PYTHON:-.venv/bin/python}
ALL_METHODS=(dp ddp launch spawn amp horovod slurm fsdp deepspeed)
methods=$(IFS=,; echo "${ALL_METHODS[*]}")
data="" dummy=0 epochs=4 nproc="" dry_run=0 benchmark=0 repeats=3 logs=logs profile=""
extra=()

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "start.sh: error: $*" >&2; exit 2; }

while (( $# )); do
    case $1 in
        --methods) methods=${2:?}; shift 2 ;;
        --data) data=${2:?}; shift 2 ;;
        --dummy) dummy=1; shift ;;
        --epochs) epochs=${2:?}; shift 2 ;;
        --nproc) nproc=${2:?}; shift 2 ;;
        --benchmark) benchmark=1; shift ;;
        --repeats) repeats=${2:?}; shift 2 ;;
        --logs) logs=${2:?}; shift 2 ;;
        --profile) profile=${2:?}; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) usage ;;
        --) shift; extra=("$@"); break ;;
        *) echo "start.sh: error: unknown option '$1'" >&2; usage 2 ;;
    esac
done
[[ -x $PY ]] || die "$PY not found: run 'bash scripts/install.sh' first (or set PYTHON)"
for m in ${methods//,/ }; do
    [[ " ${ALL_METHODS[*]} " == *" $m "* ]] || die "unknown method '$m' in --methods: pick from ${ALL_METHODS[*]}"
done

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [[ -z $nproc ]]; then
    nproc=$(( gpus > 0 ? gpus : 2 ))
fi
# Each CPU process gets its share of the cores; more threads than cores only thrash.
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}
# torchrun restarts on torch 2.14 reuse the rendezvous TCP store, whose stale peer addresses made
# restarted workers fail or hang (3 of 5 trials here); a fresh store per attempt fixes it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# The recipe every method shares: the demo digits, ImageNet (--data) with its defaults, or synthetic
# images (--dummy, --benchmark). On the digits the lr drops after epoch 3 (of the default 4): every
# method measured 90-95% top-1 then, in 23-73 s each, 5.5 minutes for all 8 on 2 cores (docs/measurements.md).
if (( benchmark )); then
    recipe=(--dummy --dummy-samples $(( 64 * nproc * 8 )) --image-size 32 -b $(( 16 * nproc )) --epochs 2 -p 1000000)
    logs=$logs/benchmark
elif (( dummy )); then
    recipe=(--dummy --epochs "$epochs")
elif [[ -n $data ]]; then
    recipe=(--data "$data" --epochs "$epochs")
else
    data=data/digits
    recipe=(--data "$data" --image-size 32 -j 1 -b 32 --lr 0.1 --epochs "$epochs" --lr-step-size 3
            --min-crop-scale 0.35)
fi
recipe+=("${extra[@]}")

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

# Sets cmd to the launch command of method $1, or skip to why this machine cannot run it.
method_command() {
    local m=$1 out=$logs/checkpoints/$1
    cmd=() skip=""
    case $m in
        dp)
            # One process drives --nproc GPUs; on CPU it is plain training, so give it all the cores.
            cmd=(env OMP_NUM_THREADS=$(( OMP_NUM_THREADS * nproc )) "$PY" dataparallel.py)
            if (( gpus > 0 )); then cmd+=(--gpus "$(seq -s, 0 $(( nproc - 1 )))"); fi ;;
        ddp) cmd=("$(dirname "$PY")/torchrun" --standalone --nproc-per-node="$nproc" distributed.py) ;;
        launch)
            cmd=("$PY" -m torch.distributed.launch --nproc_per_node="$nproc" --master_port="$(free_port)"
                 distributed.py) ;;
        spawn) cmd=("$PY" multiprocessing_distributed.py --nprocs "$nproc") ;;
        amp)
            # Its default: fp16 on GPUs; bf16 on CPUs that compute it natively, else float32 (emulated
            # bf16 made a step 23x slower on an AVX2 CPU).
            cmd=("$(dirname "$PY")/torchrun" --standalone --nproc-per-node="$nproc" apex_distributed.py) ;;
        horovod)
            if ! "$PY" -c 'import horovod.torch' 2>/dev/null; then
                skip="Horovod not installed (bash scripts/install_horovod.sh)"
            fi
            cmd=("$(dirname "$PY")/horovodrun" -np "$nproc" -H "localhost:$nproc" --gloo "$PY" horovod_distributed.py) ;;
        slurm)
            if ! command -v srun >/dev/null || ! scontrol ping 2>/dev/null | grep -q UP; then
                skip="no Slurm cluster up (bash scripts/slurm_cluster.sh start)"
            fi
            cmd=(srun -N1 -n"$nproc")
            # With GPUs, ask Slurm for them where it manages them (gres): where it confines jobs to
            # their GPUs, a job that asks for none sees none, and would train on the CPU.
            if (( gpus > 0 )) && sinfo -h -o %G 2>/dev/null | grep -q gpu; then cmd+=(--gres=gpu:"$nproc"); fi
            cmd+=("$PY" distributed_slurm_main.py) ;;
        fsdp) cmd=("$(dirname "$PY")/torchrun" --standalone --nproc-per-node="$nproc" fsdp_distributed.py) ;;
        deepspeed)
            if ! "$PY" -c 'import deepspeed' &>/dev/null; then
                skip="DeepSpeed not installed (bash scripts/install.sh --tests)"
            fi
            # DeepSpeed's own launcher (its default port is a fixed 29500). Without GPUs it still sets
            # CUDA_VISIBLE_DEVICES=0..N-1 for its processes; the script then trains on the CPU.
            cmd=("$(dirname "$PY")/deepspeed" --num_gpus "$nproc" --master_port "$(free_port)"
                 deepspeed_distributed.py) ;;
    esac
    local script
    for script in "${cmd[@]}"; do
        [[ $script == *.py && ! -f $script ]] && skip="$script does not exist yet"
    done
    cmd+=("${recipe[@]}" ${profile:+--profile "$profile"} --output-dir "$out")
}

run_method() {  # run_method METHOD: run it, appending to its log, showing its per-epoch lines as it goes
    local m=$1 log=$logs/$1.log
    method_command "$m"
    echo "== $m: ${cmd[*]}"
    (( dry_run )) && return
    # A fresh run each time, as its log: a trainer refuses an --output-dir another run left checkpoints in.
    rm -rf "$logs/checkpoints/$m"
    local start=$SECONDS status=0
    "${cmd[@]}" >>"$log" 2>&1 &
    local pid=$!
    # Progress: one short line per finished epoch, and any error line.
    tail -n0 -F --pid=$pid "$log" 2>/dev/null | grep --line-buffered -E '^(\[[0-9]+\]<std(out|err)>:)?(SUMMARY|error)' | sed -u -E \
        -e 's/.*"epoch": ([0-9]+).*"val_acc1": ([0-9]+\.?[0-9]?)[0-9]*.*"epoch_time": ([0-9.]+), "images_per_sec": ([0-9.]+).*/   epoch \1: val top-1 \2 %, \3 s, \4 images\/s/' \
        -e 's/^SUMMARY .*"epoch": ([0-9]+).*"images_per_sec": ([0-9.]+).*/   epoch \1: \2 images\/s/' &
    wait $pid || status=$?
    wait
    # Each repeat's metrics log, kept beside its text log for statistics.sh (the next repeat removes the run's directory).
    [[ -f $logs/checkpoints/$m/metrics.jsonl ]] && cat "$logs/checkpoints/$m/metrics.jsonl" >>"$logs/$m.metrics.jsonl"
    if [[ -n $profile ]] && (( status == 0 )); then
        "$PY" tools/profile_split.py --json "$logs/checkpoints/$m" >>"$logs/$m.profile.jsonl" || status=$?
    fi
    echo "   $m finished in $(( SECONDS - start )) s (exit $status)"
    (( status == 0 )) || failed+=("$m")
}

if [[ $data == data/digits && ! -f $data/demo.json ]] && (( ! dry_run )); then
    "$PY" tools/make_demo_data.py --out "$data"
fi
mkdir -p "$logs"
echo "start.sh: $nproc processes ($( (( gpus > 0 )) && echo "$gpus GPUs" || echo "CPU, $OMP_NUM_THREADS threads each")), logs in $logs/"
runnable=()
for m in ${methods//,/ }; do
    method_command "$m"
    if [[ -n $skip ]]; then
        echo "== $m: skipped: $skip"
    else
        runnable+=("$m")
        (( dry_run )) || { : >"$logs/$m.log" >"$logs/$m.metrics.jsonl"; rm -f "$logs/$m.profile.jsonl"; }
    fi
done
failed=()
if (( benchmark )); then
    if (( ! dry_run )); then : >"$logs/bare.log"; : >"$logs/ceiling.log"; fi
    bare=("$(dirname "$PY")/torchrun" --standalone --nproc-per-node="$nproc" benchmarks/bare_ddp.py "${recipe[@]}")
    # The same per-process work with no communication at all: the ceiling of any data-parallel method.
    ceiling=("${bare[@]}" --no-communication)
    # Alternate the yardsticks and the methods, so a noisy machine slows all alike; statistics.sh
    # takes medians.
    for (( r = 1; r <= repeats; r++ )); do
        echo "== bare (run $r/$repeats): ${bare[*]}"
        (( dry_run )) || "${bare[@]}" >>"$logs/bare.log" 2>&1 || failed+=(bare)
        echo "== ceiling (run $r/$repeats): ${ceiling[*]}"
        (( dry_run )) || "${ceiling[@]}" >>"$logs/ceiling.log" 2>&1 || failed+=(ceiling)
        for m in "${runnable[@]}"; do run_method "$m"; done
    done
else
    for m in "${runnable[@]}"; do run_method "$m"; done
fi
(( dry_run )) && exit 0
bash statistics.sh "$logs"
if (( ${#failed[@]} )); then
    echo "start.sh: error: failed: ${failed[*]} (see their logs in $logs/)" >&2
    exit 1
fi
