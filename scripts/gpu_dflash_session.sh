#!/bin/sh
# On the device machine: one session's DFlash pipeline for a target, run detached so that it outlasts the calls
# (issue 13's runs of the twenty-seventh to twenty-ninth sessions):
#   setsid nohup sh scripts/gpu_dflash_session.sh MODEL.gguf TARGET_NAME [train dflash options ...] > LOG 2>&1 &
# 1. trains a drafter into /root/run (`scripts/gpu_train_dflash.sh`, OUT unset; e.g. --init FILE --seed N to go on
#    from a shipped drafter), 2. splits it into 15 MiB parts in /root/parts (with its json), and the answers' tokens
#    (data.safetensors, ~19 MB for 16k prompts: a later session's --add-data) into /root/dataparts, for later calls
#    to copy back, 3. waits until no `python3 -m pytest` runs (the timings need the GPU alone), 4. times
#    `bench spec` against compiled plain decoding, one run a name of RUNS (default "t0-b1 t1-b1 b4"), each into
#    /root/eval/spec-NAME with `bench spec --time-limit` (no prompt batch starts after the limit; the report covers
#    the prompts measured, each with every drafter) and `timeout` 300 s later as a backstop:
#      t0-b1  HumanEval, T = 0, batch 1, 164 problems (330 s)     t1-b1  HumanEval, T = 1, batch 1, 48 (150 s)
#      b4     HumanEval, T = 0 and 1, batch 4, 32 (150 s)          text   held-out chat text prompts, T = 0 and 1,
#      fp32   HumanEval, T = 0, batch 8, target in fp32, 164           batch 1, 48 (150 s)
#             problems, no compile (300 s; greedy identity)       cycle  bench/tree_cycle.py: a step's parts, line
#                                                                        and tree15, compiled, with kernels
#      long-b16, long-b4, long-b1  issue 15: held-out long-code prompts of CHARS characters (default 100,000:
#             ~22k-30k tokens), batch 16 (16 prompts, T = 0, 400 s), 4 (8, T = 0 and 1, 250 s), 1 (4, T = 0, 200 s);
#             LONG_KINDS other long kinds (e.g. long-code,long-text: document questions and summaries too)
#    each with DRAFTERS (default "dflash:D ngram+dflash:D", D the drafter); LIMIT (seconds) replaces every limit;
#    BLOCK the block size (default 16; at long context a tuned drafter's runs rarely pass 8: a narrower verify);
#    BENCH_OPTS more `bench spec` options for every run (e.g. --ignore-eos: every row decodes all its tokens).
# RUN: the run folder (default /root/run; passed on to gpu_train_dflash.sh). SKIP_TRAIN=1 benches the drafter
# already in it, or DRAFTER (a path without .safetensors, e.g. the shipped
# sparsespec/drafters/qwen2.5-coder-1.5b-dflash). Each line of progress goes to the log with the time.
model=$1; name=$2; shift 2
export PYTHONPATH=.:/tmp/site:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
R=${RUN:-/root/run}; D=${DRAFTER:-$R/drafter}; E=/root/eval; mkdir -p $E
if [ -z "$SKIP_TRAIN" ]; then
  echo "train start $(date +%T)"
  OUT= sh scripts/gpu_train_dflash.sh "$model" --target-name "$name" "$@" > /root/train.out 2>&1
  echo "train done $(date +%T)"
fi
[ -f $D.safetensors ] || { echo "no drafter at $D.safetensors"; exit 1; }
if [ -z "$SKIP_TRAIN" ]; then  # the drafter, and the answers' tokens for a later --add-data, in parts to copy back
  rm -rf /root/parts && python3 scripts/chunks.py split $D.safetensors /root/parts --size 15 && cp $D.json /root/parts/
  rm -rf /root/dataparts && python3 scripts/chunks.py split $R/data.safetensors /root/dataparts --size 15
fi
# (the pattern is a test run's command line: a call that only reads a pytest log must not hold the benchmark back)
while pgrep -f "python3 -m pytest" > /dev/null; do sleep 3; done
bench() {  # NAME SECONDS [bench spec options ...]
  run=$1; limit=${LIMIT:-$2}; shift 2
  echo "$run start $(date +%T)"
  timeout $((limit + 300)) python3 -m sparsespec bench spec --target "$model" --target-name "$name" \
    --drafters ${DRAFTERS:-dflash:$D ngram+dflash:$D} --max-new-tokens 128 --block-size ${BLOCK:-16} --device cuda \
    --time-limit "$limit" --out $E/spec-$run $BENCH_OPTS "$@" > $E/spec-$run.log 2>&1
  rc=$?
  echo "$run done $(date +%T) rc $rc (124: stopped by the backstop, 300 s past the time limit)"
}
for run in ${RUNS:-t0-b1 t1-b1 b4}; do
  case $run in
    t0-b1) bench $run 330 --compile --kinds humaneval --prompts 164 --batch 1 --temperatures 0 ;;
    t1-b1) bench $run 150 --compile --kinds humaneval --prompts 48 --batch 1 --temperatures 1 ;;
    b4) bench $run 150 --compile --kinds humaneval --prompts 32 --batch 4 --temperatures 0,1 ;;
    text) bench $run 150 --compile --kinds text --prompts 48 --batch 1 --temperatures 0,1 ;;
    fp32) bench $run 300 --dtype float32 --kinds humaneval --prompts 164 --batch 8 --temperatures 0 ;;
    long-b16) bench $run 400 --compile --kinds ${LONG_KINDS:-long-code} --long-chars ${CHARS:-100000} --prompts 16 --batch 16 \
      --temperatures 0 ;;
    long-b4) bench $run 250 --compile --kinds ${LONG_KINDS:-long-code} --long-chars ${CHARS:-100000} --prompts 8 --batch 4 \
      --temperatures 0,1 ;;
    long-b1) bench $run 200 --compile --kinds ${LONG_KINDS:-long-code} --long-chars ${CHARS:-100000} --prompts 4 --batch 1 \
      --temperatures 0 ;;
    cycle) echo "cycle start $(date +%T)"  # a step's parts, line against tree15 (random weights in the shape)
      timeout 600 python3 bench/tree_cycle.py --shape "$name" --compile --profile --out $E/tree-cycle \
        > $E/tree-cycle.log 2>&1
      rc=$?; echo "cycle done $(date +%T) rc $rc" ;;
    *) echo "unknown run $run (t0-b1, t1-b1, b4, text, fp32, long-b16, long-b4, long-b1, cycle)" ;;
  esac
done
echo "all done $(date +%T)"
