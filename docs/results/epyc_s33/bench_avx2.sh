#!/usr/bin/env bash
# training throughput under the AVX2 cap, paired in 3 rounds: baseline, the fused optimizer on its own, all exact
# levers in one 2-thread process, and the same over 2 torchrun ranks x 1 thread
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 HSPEC_CPU_BF16=0 HSPEC_TRAIN_THREADS=2
.venv/bin/python scripts/bench_train.py --data data/smollm2_prompts/train.jsonl --steps 8 --rounds 3 \
  --rows "fused_optimizer,all_exact,all_exact + data_parallel" --out runs/bench_avx2
