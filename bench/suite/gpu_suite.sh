#!/usr/bin/env bash
# The GPU suite: what a GPU machine held briefly measures, in two calls sized for 15 minutes of
# device time (machine start 1-3 min, one command at most 10 min; CONTRIBUTING.md, GPU tests).
#
#   bash bench/suite/gpu_suite.sh OUT --core        # the decisive facts, in order of value, 5 min
#   bash bench/suite/gpu_suite.sh OUT               # the full call: everything else, 5.5 min
#                                                   # of its ~11 (--only STEP picks)
#   bash bench/suite/gpu_suite.sh OUT --dry-run     # CPU: both calls' steps, full-size flags, up to
#                                                   # the engine configuration (CI runs it)
#   bash bench/suite/gpu_suite.sh OUT --core --device cpu --smoke   # tiny shapes end to end on a CPU
#   bash bench/suite/gpu_suite.sh OUT --core --only stream-gaps     # some steps of a call again
#
# The core call: a smoke test of the shape cut to 2 layers with CUDA graphs (if the capture
# fails, every later step runs --enforce-eager and the summary says so); decode TPOT at batch
# 1 and 64 against the HBM bound, graphs against eager, prefill against the linear-layer
# bound, and each engine's startup (load, warm-up, capture, graph memory); the TTFT line's
# calibration in its own process; the SLO burst over HTTP by the client's clock, fcfs against
# the default policy, at budget 2048; the first request's stream gaps at three context
# lengths. The full call: greedy equality against HF, structured outputs' TPOT, the GPU tests,
# preemption latency, the SLO burst over HTTP unchunked (from the core call's TTFT line when
# OUT holds it), throughput against HF transformers with the engine's profile (async
# scheduling), the kernels, the compiled-Triton tests and the SLO burst in process.
#
# One deadline for the whole call (--deadline-s; core 330 s, full 330 s): each step gets the
# smaller of its own limit and the time left, a step with too little time left is skipped, and
# the summary is written from an EXIT trap whatever happens (a step killed, the call
# interrupted). OUT/steps.tsv gets a step's row before it starts (rc "running") and its outcome
# after; each benchmark appends its figures to a .jsonl file as it measures them, so a killed
# step loses nothing it measured. OUT/summary.md (printed at the end) is what bench/RESULTS.md
# takes as is; OUT/suite.json holds every step's figures. Exit status: 0 when every step passed.
set -uo pipefail

usage="usage: bash bench/suite/gpu_suite.sh OUT_DIR [--core] [--dry-run] [--device auto|cpu|cuda] \
[--smoke] [--shape NAME] [--deadline-s S] [--limit STEP=S]... [--only STEP]... \
[--assume-capture-failed]"
[[ $# -ge 1 && $1 != -* ]] || { echo "$usage" >&2; exit 2; }
out=$1; shift
device=auto; smoke=0; shape=llama-3.1-8b; call=""; dry_run=0; deadline_s=""; eager_from_start=0
declare -A limit_override=()
declare -A only_steps=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --core) call=core; shift ;;
        --dry-run) dry_run=1; shift ;;
        # Every engine runs --enforce-eager, as after a failed capture (the dry run checks
        # those commands this way).
        --assume-capture-failed) eager_from_start=1; shift ;;
        --device) device=$2; shift 2 ;;
        --smoke) smoke=1; shift ;;
        --shape) shape=$2; shift 2 ;;
        --deadline-s) deadline_s=$2; shift 2 ;;
        # A step's own limit, replaced (a test kills a step this way).
        --limit)
            [[ ${2#*=} =~ ^[1-9][0-9]*$ ]] || { echo "--limit STEP=S: S is whole seconds >= 1" >&2; exit 2; }
            limit_override[${2%%=*}]=${2#*=}; shift 2 ;;
        # Run only the named steps of the call (a second call for the steps a first one lost to
        # their limits; put the first call's ttft_model.json in OUT for the bursts).
        --only) only_steps[$2]=1; shift 2 ;;
        *) echo "unknown argument $1; $usage" >&2; exit 2 ;;
    esac
done
# The folder that holds the engine and bench packages (and tests/ in a checkout).
cd "$(dirname "$0")/../.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}
# Each step's Python module runs as `"${pym[@]}" MODULE ARGS...`: `python -m MODULE ARGS...`.
pym=($py -m)

if [[ $dry_run == 1 ]]; then
    # Both calls, exactly as a GPU machine runs them, each command run through the dry run's
    # launcher (bench/suite/dry_run.py), which stops it once it has built its engine
    # configuration. The device is the GPU's unless named.
    pym=($py -m bench.suite.dry_run)
    # A dry run's command exits as soon as its configuration is built, before its temporary
    # folders are cleaned up: they go under OUT.
    mkdir -p "$out/tmp"
    export TMPDIR="$out/tmp"
    [[ -z $call ]] && call=both
    [[ $device == auto ]] && device=cuda
elif [[ $device == auto ]]; then
    device=$($py -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
fi
if [[ $device == cpu && $smoke == 0 && $dry_run == 0 ]]; then
    echo "no GPU (device cpu): the full suite's shapes would take hours on a CPU; pass --smoke" >&2
    exit 2
fi

# The limits are an H100's; a shared 2-core CI machine gets four times as long for --smoke.
[[ -z $call ]] && call=full
limit_scale=1
[[ $smoke == 1 ]] && limit_scale=4
if [[ -z $deadline_s ]]; then
    case $call in
        core) deadline_s=$((330 * limit_scale)) ;;
        full) deadline_s=$((330 * limit_scale)) ;;
        both) deadline_s=$((660 * limit_scale)) ;;
    esac
fi
# Kept back for the summary, and the grace a killed step gets to exit.
summary_reserve_s=10
kill_grace_s=10

: > "$out/steps.tsv"
: > "$out/notes.txt"
current_step_pid=""
current_step=""

note() { echo "$*" | tee -a "$out/notes.txt"; }

# set_row NAME RC SECONDS LIMIT: NAME's row in steps.tsv, replaced in place or appended.
set_row() {
    local row
    row=$(printf '%s\t%s\t%s\t%s' "$@")
    awk -F'\t' -v name="$1" -v row="$row" \
        'BEGIN { done = 0 } $1 == name { print row; done = 1; next } { print }
         END { if (!done) print row }' "$out/steps.tsv" > "$out/steps.tsv.new"
    mv "$out/steps.tsv.new" "$out/steps.tsv"
}

summarize() {
    local status=$?
    trap - EXIT
    if [[ -n $current_step ]]; then
        # Interrupted mid-step: its row says so; the step's own files keep what it measured.
        set_row "$current_step" killed "$((SECONDS - step_started))" "$step_limit"
    fi
    $py -m bench.suite.gpu_summary "$out" --device "$device" $([[ $smoke == 1 ]] && echo --smoke) \
        $([[ $dry_run == 1 ]] && echo --dry-run)
    if [[ $status == 0 ]]; then
        awk -F'\t' '$2 != 0 { bad = 1 } END { exit bad }' "$out/steps.tsv"
        status=$?
    fi
    exit "$status"
}
trap summarize EXIT

interrupted() {
    if [[ -n $current_step_pid ]]; then
        # timeout forwards the signal to the step's process group.
        kill -TERM "$current_step_pid" 2>/dev/null
        wait "$current_step_pid" 2>/dev/null
    fi
    exit 143
}
trap interrupted TERM INT HUP

# step NAME LIMIT_S COMMAND...: run it with its log in OUT_DIR/NAME.log under the smaller of its
# limit and the time the deadline leaves, and record its outcome (124/137: killed at the limit).
step() {
    local name=$1 own=$2; shift 2
    if [[ ${#only_steps[@]} -gt 0 && -z ${only_steps[$name]:-} ]]; then
        return 0
    fi
    [[ -n ${limit_override[$name]:-} ]] && own=${limit_override[$name]}
    own=$((own * limit_scale))
    local left=$((deadline_s - SECONDS - summary_reserve_s - kill_grace_s))
    if ((left < 5)); then
        echo "== $name: skipped, the call's deadline (${deadline_s}s) leaves ${left}s"
        set_row "$name" skipped 0 0
        return
    fi
    step_limit=$((own < left ? own : left))
    step_started=$SECONDS
    current_step=$name
    set_row "$name" running 0 "$step_limit"
    echo "== $name (limit ${step_limit}s): $*"
    # In the background, so that a signal to the suite is handled at once, not after the step.
    timeout --kill-after=$kill_grace_s "$step_limit" "$@" > "$out/$name.log" 2>&1 &
    current_step_pid=$!
    wait "$current_step_pid"
    local rc=$?
    current_step_pid=""
    current_step=""
    set_row "$name" "$rc" "$((SECONDS - step_started))" "$step_limit"
    echo "   rc $rc in $((SECONDS - step_started))s"
    return "$rc"
}

# -- the model folders ----------------------------------------------------------------------
if [[ $smoke == 1 ]]; then
    # A tiny random Llama stands in for the real shape; the benches run their --smoke sizes.
    model="$out/model"
    $py -c "
from pathlib import Path
from engine.benchmarks.inputs.model_shapes import cover_vocabulary
from engine.benchmarks.inputs.random_checkpoints import make_random_model, save_small_tokenizer
save_small_tokenizer('$model')
cover_vocabulary(Path('$model'), 512)  # every id the model samples shows as text
make_random_model('$model', 'llama', vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, initializer_range=0.3)" > /dev/null 2>&1 \
        || { echo "could not build the smoke model" >&2; exit 1; }
    smoke_model=$model
    load=(--load-format auto)
    smoke_flag=(--smoke)
    # The GPU tests are collected (so an import or fixture error shows), not run: CI runs them
    # on the CPU in the main suite.
    test_mode=(--collect-only)
    export SLOSERVE_STARTUP_CALIBRATION_S=${SLOSERVE_STARTUP_CALIBRATION_S:-0.3}
    long_prompt=400; trials=3; contexts=(16 200); burst=(--num-requests 6 --rates 4)
    # Up to 1536 tokens: on the tiny model a 256-token prompt costs about what a 16-token one
    # does, and on a busy 2-core machine the line fitted to 16-256 once came out sloping down,
    # which the burst then refused.
    calibration=(--prompt-sizes 16 256 768 1536 --repeats 1 --decode-batches 1
                 --decode-contexts 64 --max-num-batched-tokens 1536)
    chunk=(--chunk-tokens 128)
    decode_batches=()  # the throughput bench's own smoke sizes
    # The in-process burst calibrates its own TTFT line: each prompt size once, not three times.
    inprocess_calibration=(--calibration-repeats 1)
    structured_sizes=(--batch 4 --max-tokens 16 --rounds 1)
else
    model="$out/model-$shape"
    smoke_model="$out/model-$shape-2-layers"
    $py -m engine bench shape "$shape" "$model" --small-tokenizer > /dev/null \
        && $py -m engine bench shape "$shape" "$smoke_model" --small-tokenizer \
            --num-hidden-layers 2 > /dev/null \
        || { echo "could not write the $shape shape" >&2; exit 1; }
    load=(--load-format dummy)
    smoke_flag=()
    test_mode=()
    [[ $dry_run == 1 ]] && test_mode=(--collect-only)
    long_prompt=16384; trials=10; contexts=(16 3000 12000)
    burst=(--num-requests 16 --rates 2)
    # As `bench run` calibrates on a GPU: prompts up to 32k tokens, each one step.
    calibration=(--prompt-sizes 16 256 1024 2048 4096 8192 16384 32768 --repeats 2
                 --max-num-batched-tokens 32768)
    chunk=()
    decode_batches=(--batches 1 64 --eager-batches 1 64)
    inprocess_calibration=()
    structured_sizes=(--batch 16 --max-tokens 64 --rounds 3)
fi
# --enforce-eager for every engine after a failed graph capture in the smoke step.
eager=()
if [[ $eager_from_start == 1 ]]; then
    eager=(--enforce-eager)
    note "--assume-capture-failed: every engine after the smoke step ran --enforce-eager"
fi

# burst_http BUDGET (2048 or unchunked): the SLO burst over HTTP, fcfs then the default policy,
# one server each (on the H100, 20-35 s to start one: spawn, CUDA init, warm-up, capture).
burst_http() {
    step "burst-http-$1" 150 "${pym[@]}" engine bench run --model "$model" "${load[@]}" \
        --device "$device" "${eager[@]}" --workload burst --arrival gamma --burstiness 4 \
        "${burst[@]}" --seeds 0 --budgets "$([[ $1 == 2048 ]] && echo 2048 || echo large)" \
        --policies fcfs slo+mf-conservative-suspend --ttft-model "$out/ttft_model.json" \
        --runner http --output-dir "$out/burst-http-$1"
}

# The limits are the first H100 run's times (2026-11-27: smoke 22 s, throughput 26, calibrate
# 36, a burst ~130, stream gaps ~50) with a margin.
run_core() {
    step smoke 45 "${pym[@]}" bench.suite.gpu_smoke --model "$smoke_model" "${load[@]}" \
        --device "$device" "${chunk[@]}" --output "$out/smoke.json"
    case $? in
        0) ;;
        3) eager=(--enforce-eager)
           note "CUDA graph capture failed in the smoke step: every later step ran" \
                "--enforce-eager (smoke.log has the error)" ;;
        *) note "the engine did not serve in the smoke step (smoke.log); the later steps ran" \
                "as configured" ;;
    esac
    # Two engines, one after the other (graphs, then --enforce-eager); no HF, no profiler.
    step throughput 60 "${pym[@]}" bench.suite.gpu_throughput --device "$device" "${smoke_flag[@]}" \
        --shape "$shape" --no-hf "${decode_batches[@]}" "${eager[@]}" \
        --output "$out/throughput.json"
    # The TTFT line in its own process: the burst's servers start from it, none calibrates.
    step calibrate 60 "${pym[@]}" engine calibrate --model "$model" "${load[@]}" --device "$device" \
        "${eager[@]}" --startup-calibration off "${calibration[@]}" \
        --output "$out/ttft_model.json"
    burst_http 2048
    step stream-gaps 75 "${pym[@]}" bench.e2e.stream_gaps --model "$model" "${load[@]}" \
        --device "$device" "${eager[@]}" --contexts "${contexts[@]}" --output "$out/stream_gaps.json"
}

# The second H100 run (2026-11-27) measured the full call: equality 66 s, preempt-latency
# 35, the unchunked burst 112, throughput-hf 70, kernels 18; the compiled-Triton tests needed
# more than the 60 s its deadline left them. The third (2026-11-28): structured 39 s,
# preempt-latency 41, the unchunked burst 123; tests-cuda more than 60. All of it needs about
# 650 s: more than the default deadline, which fits 15 minutes of device time on a machine
# that took 3 minutes to start; a shorter run picks its steps with --only (CONTRIBUTING, GPU tests).
run_full() {
    step equality 80 "${pym[@]}" bench.suite.gpu_equality --device "$device" "${smoke_flag[@]}" \
        --output "$out/equality.json"
    # Structured outputs on the device: a batch of 16 under a JSON schema against
    # the same batch unconstrained, the bitmask filled on the host and applied in the sampler.
    # Every constrained token the grammar refuses would fail its request, which the bench
    # asserts against; on the CPU (2026-11-27) the overhead was 1.2% of a 54.5 ms TPOT.
    step structured 90 "${pym[@]}" engine bench structured --model "$model" "${load[@]}" \
        --device "$device" "${structured_sizes[@]}" --output "$out/structured.json"
    # Only the GPU's cases, compiled in this pytest: CI runs the device_cpu ones, and on the
    # H100 (2026-11-27) they took the step's whole limit after its GPU cases had passed. Alone
    # they needed more than 60 s (2026-11-28: 35 of 38 in 60 s). -v: a killed step's log ends
    # with the test it was running; --durations: the slowest, when it ends.
    step tests-cuda 120 env TRITON_INTERPRET=$([[ $device == cuda ]] && echo 0 || echo 1) \
        $py -m pytest -v --durations=10 -p no:cacheprovider "${test_mode[@]}" -m gpu \
        -k "not device_cpu" tests/gpu
    # Two sizes on one engine: the long prompt's step runs eager, a 512-token step replays as
    # pieces with the vote between them (the smoke run's 128 is the smallest preemptible step).
    step preempt-latency 60 "${pym[@]}" bench.e2e.preempt_latency --model "$model" "${load[@]}" \
        --device "$device" --prompt-tokens "$long_prompt" \
        $([[ $smoke == 1 ]] && echo 128 || echo 512) --trials "$trials" \
        --output "$out/preempt_latency.json"
    # Unchunked, an urgent turn starts in time only if the document's pass is stopped between
    # layers. The servers start from the core call's TTFT line (CONTRIBUTING copies it into OUT
    # on the same machine); without it, this call calibrates first.
    if [[ ! -f $out/ttft_model.json ]]; then
        step calibrate 60 "${pym[@]}" engine calibrate --model "$model" "${load[@]}" \
            --device "$device" "${eager[@]}" --startup-calibration off "${calibration[@]}" \
            --output "$out/ttft_model.json"
    fi
    burst_http unchunked
    # The engine (graphs) beside HF transformers, and the engine's torch.profiler summary; no
    # kind's profile starts after 70 s of the run. With async scheduling: the core call's
    # throughput step timed the serial loop, this one the loop that schedules ahead, and the
    # profiler shows how long the GPU still waits between steps.
    step throughput-hf 100 "${pym[@]}" bench.suite.gpu_throughput --device "$device" "${smoke_flag[@]}" \
        --shape "$shape" --no-eager --async-scheduling --profile \
        --profile-until-s $((70 * limit_scale)) \
        --output "$out/throughput-hf.json"
    if [[ $device == cuda ]]; then
        step kernels 25 "${pym[@]}" bench.kernels.gpu_kernels --repeats 10 --output "$out/kernels.json"
    else
        step kernels 25 "${pym[@]}" bench.kernels.gpu_kernels --smoke --sections decode --output "$out/kernels.json"
    fi
    # Compiles every kernel variant the tests use from an empty Triton cache.
    step tests-triton-compiled 120 env TRITON_INTERPRET=$([[ $device == cuda ]] && echo 0 || echo 1) \
        $py -m pytest -v --durations=10 -p no:cacheprovider "${test_mode[@]}" -m gpu tests/kernels
    step burst-inprocess 90 "${pym[@]}" engine bench run --model "$model" "${load[@]}" \
        --device "$device" --workload burst --arrival gamma --burstiness 4 "${burst[@]}" \
        --seeds 0 --budgets 2048 --policies fcfs slo+mf-conservative-suspend --runner inprocess \
        "${inprocess_calibration[@]}" --output-dir "$out/burst-inprocess"
}

case $call in
    core) run_core ;;
    full) run_full ;;
    both) run_core; run_full ;;
esac
exit 0
