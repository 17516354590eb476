#!/usr/bin/env bash
# quiet benchmarks with the shipped drafter (1.900), after the CE lever's eval: policies on the reference engine
# (fp32, token-exact), then SGLang CPU serving. Nothing else runs.
set -uo pipefail
cd /work/main
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
while ! grep -q "eval done" runs/s21/ce.log; do sleep 15; done
echo "policies start $(date)"
.venv/bin/python scripts/bench_policies.py --drafters shipped --policies fixed,exact,stale,auto --control \
  --sts docs/results/sts_hspec_smollm2.json --batch-sizes 1,4,16,32 --max-new-tokens 32 --dtype fp32 --threads 2 \
  --repeats 3 --out docs/results/policies_smollm2_cpu.json > runs/s21/policies.log 2>&1
echo "policies done $(date) rc=$?"
ROUNDS=2 scripts/bench_serve_cpu.sh docs/results/serve_cpu/shipped_2026-12-05 > runs/s21/serve.log 2>&1
echo "serve done $(date) rc=$?"
