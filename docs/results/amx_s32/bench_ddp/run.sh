#!/usr/bin/env bash
# The trainer's own data parallelism (torchrun, gloo on CPU) as the fp32 lever: under the AVX2 cap, 8 steps each of
#   base: the baseline row (no levers), one process x 2 threads
#   A:    all exact levers (warm feature cache), one process x 2 threads, 2 sequences per step
#   B:    the same, torchrun 2 ranks x 1 thread, 1 sequence per rank (the same global batch of 2)
# in the order base A B base A B. A and B read runs/s32/fcache_avx2, an fp32 feature cache of these 8 steps made
# warm beforehand (the bench_dp run's cache, copied): without it A r1 fills it cold and reads slower.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 HSPEC_CPU_BF16=0
o=runs/s32/bench_ddp; mkdir -p $o
common=(--config configs/train_hspec_smollm2.yaml --no-progress data.train_path=data/smollm2_prompts/train.jsonl
        training.max_steps=8 training.save_every=0 training.log_every=1 model.target_dtype=fp32 training.bf16=false)
exact=(training.target_probs_once=true training.pack_anchors=true training.sequence_attention=true
       training.cached_log_partition=true data.feature_cache=runs/s32/fcache_avx2)
base=(training.target_probs_once=false training.pack_anchors=false training.sequence_attention=false
      training.cached_log_partition=false data.feature_cache=null)
for r in 1 2; do
  echo "=== $(date -u +%H:%M:%S) base r$r"; rm -rf $o/base_r$r
  OMP_NUM_THREADS=2 HSPEC_TRAIN_THREADS=2 .venv/bin/hspec train "${common[@]}" "${base[@]}" training.output_dir=$o/base_r$r > $o/base_r$r.log 2>&1
  echo "=== $(date -u +%H:%M:%S) A r$r"; rm -rf $o/A_r$r
  OMP_NUM_THREADS=2 HSPEC_TRAIN_THREADS=2 .venv/bin/hspec train "${common[@]}" "${exact[@]}" training.output_dir=$o/A_r$r > $o/A_r$r.log 2>&1
  echo "=== $(date -u +%H:%M:%S) B r$r"; rm -rf $o/B_r$r
  OMP_NUM_THREADS=1 HSPEC_TRAIN_THREADS=1 .venv/bin/torchrun --standalone --nproc_per_node 2 -m sglang_hspec.training.trainer \
    "${common[@]}" "${exact[@]}" data.batch_size=1 training.output_dir=$o/B_r$r > $o/B_r$r.log 2>&1
done
echo "=== $(date -u +%H:%M:%S) done"
.venv/bin/python - <<'PY'
import json, statistics
from pathlib import Path
o = Path("runs/s32/bench_ddp")
for name in ["base_r1", "A_r1", "B_r1", "base_r2", "A_r2", "B_r2"]:
    f = o / name / "train_log.jsonl"
    if not f.exists():
        print(name, "no log"); continue
    rows = [json.loads(x) for x in f.read_text().splitlines()]
    secs = statistics.median(r["seconds"] for r in rows[1:])
    blocks = statistics.mean(r["blocks"] for r in rows)
    print(f"{name}: {blocks / secs:.1f} blocks/s, loss {rows[-1]['loss']:.4f}, step seconds {[r['seconds'] for r in rows]}")
PY
