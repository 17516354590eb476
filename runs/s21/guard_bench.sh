#!/usr/bin/env bash
set -uo pipefail
cd /work/main
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
common=(--drafters shipped --sts docs/results/sts_hspec_smollm2.json --sps-table docs/results/policies_smollm2_cpu.sps.json --dtype fp32 --threads 2 --repeats 3)
.venv/bin/python scripts/bench_policies.py "${common[@]}" --policies fixed,auto,auto-unguarded --control --batch-sizes 1,4,16,32 \
  --max-new-tokens 32 --out docs/results/policies_auto_guard_mtbench.json > runs/s21/guard_mtbench.log 2>&1
echo "mtbench done $(date)"
.venv/bin/python scripts/bench_policies.py "${common[@]}" --policies fixed,auto,auto-unguarded --batch-sizes 1,4,16 \
  --max-new-tokens 64 --dataset gsm8k --out docs/results/policies_auto_guard_gsm8k.json > runs/s21/guard_gsm8k.log 2>&1
echo "gsm8k done $(date)"
