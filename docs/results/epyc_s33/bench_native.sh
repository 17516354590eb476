#!/usr/bin/env bash
# training throughput at the native ISA (bf16 native here), paired in 3 rounds
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 HSPEC_TRAIN_THREADS=2
.venv/bin/python scripts/bench_train.py --data data/smollm2_prompts/train.jsonl --steps 8 --rounds 3 \
  --rows "all_exact,all_exact + data_parallel,all_exact + bf16,all_exact + bf16 + data_parallel" --out runs/bench_native
