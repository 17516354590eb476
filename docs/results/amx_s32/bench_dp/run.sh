#!/usr/bin/env bash
# Is data parallelism over the 2 cores a training-throughput lever? Under the AVX2 cap, the all-exact row as one
# 2-thread process (A), as two 1-thread processes at once (B: the aggregate is what 2-rank data parallelism could
# at most reach, without its all-reduce), then A again.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 HSPEC_CPU_BF16=0
o=runs/s32/bench_dp
mkdir -p $o
one() { HSPEC_TRAIN_THREADS=$1 OMP_NUM_THREADS=$1 MKL_NUM_THREADS=$1 .venv/bin/python scripts/bench_train.py --data data/smollm2_prompts/train.jsonl --steps 8 \
  --rows all_exact --out $o/$2 > $o/$2.log 2>&1; }
[ -s $o/a1/bench_train.json ] || { echo "=== $(date -u +%H:%M:%S) A1"; one 2 a1; }
echo "=== $(date -u +%H:%M:%S) B"; one 1 b_rank0 & one 1 b_rank1 & wait
echo "=== $(date -u +%H:%M:%S) A2"; one 2 a2
echo "=== $(date -u +%H:%M:%S) done"
for r in a1 b_rank0 b_rank1 a2; do echo "$r: $(tr '\r' '\n' < $o/$r.log | grep '^\[all_exact\]\|^\[baseline\]' | cut -c1-80 | tr '\n' ' ')"; done
