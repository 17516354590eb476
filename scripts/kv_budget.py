"""KV tokens at one memory budget: no speculation vs HSPEC vs SGLang's DSPARK, real SGLang servers on CPU.

Launches the three servers one after another through the CPU tier (tests/sglang_cpu/server.py) with the
same fixed KV byte budget (the CPU plugin's SGLANG_CPU_TESTING_KV_BUDGET_MB: SGLang's CPU default, free
host RAM x --mem-fraction-static, moves with whatever else runs) and no --max-total-tokens, reads
`max_total_num_tokens` from /server_info and prints the table of docs/serving.md.

    .venv-sglang/bin/python scripts/kv_budget.py                      # embedded SmolLM2, 256 MiB, float32

DSPARK's drafter: our dspark baseline exported by `hspec export-dspark`: the trained checkpoint
runs/dspark_smollm2/checkpoint-100/drafter when it exists and has q/k norms (qk_norm, which SGLang's DSpark
layers always apply; configs/train_dspark_smollm2.yaml sets it), else an untrained drafter of the real
architecture: configs/train_dspark_smollm2.yaml's model section, or the trained checkpoint's config with
qk_norm set (the pool sizing reads only layers, KV heads, head_dim and dtype).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the CPU tier: tests/sglang_cpu

TRAINED_DSPARK = ROOT / "runs" / "dspark_smollm2" / "checkpoint-100" / "drafter"
DSPARK_YAML = ROOT / "configs" / "train_dspark_smollm2.yaml"


def dspark_drafter_for(target_dir: Path, out: Path) -> tuple[Path, str]:
    """An SGLang DSpark checkpoint for `target_dir` (see the module docstring) and where it came from."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_hspec.model.checkpoint import build_drafter, save_drafter
    from sglang_hspec.model.config import HSpecConfig
    from sglang_hspec.sglang_plugin.export_dspark import export_dspark
    from sglang_hspec.training.config import load_config
    from sglang_hspec.training.trainer import drafter_config

    if TRAINED_DSPARK.exists():
        cfg = HSpecConfig.from_dict(json.loads((TRAINED_DSPARK / "config.json").read_text())["hspec"])
        if cfg.qk_norm:
            return export_dspark(TRAINED_DSPARK, out, tokenizer_from=target_dir), str(TRAINED_DSPARK)
        # trained before the recipe set qk_norm: the same architecture with the norms SGLang applies
        cfg = dataclasses.replace(cfg, qk_norm=True)
        source = f"untrained drafter with the architecture of {TRAINED_DSPARK.relative_to(ROOT)}, qk_norm set"
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    if not TRAINED_DSPARK.exists():
        cfg = drafter_config(load_config(DSPARK_YAML), target)
        source = f"untrained drafter built from {DSPARK_YAML.relative_to(ROOT)} (model section)"
    torch.manual_seed(0)
    model = build_drafter("dspark", cfg, target.get_input_embeddings(), target.get_output_embeddings())
    save_drafter(model, out / "ours")
    return export_dspark(out / "ours", out / "sglang", tokenizer_from=target_dir), source


def main(argv: list[str] | None = None) -> int:
    from sglang_cpu import server

    from sglang_hspec.assets.embedded import embedded_target_dir
    from sglang_hspec.engine.loading import SHIPPED_DRAFTER_DIR

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-mb", type=float, default=256.0, help="KV-pool byte budget of every server (MiB)")
    ap.add_argument("--target", default=None, help="target model dir (default: the embedded SmolLM2)")
    ap.add_argument("--hspec-draft", default=str(SHIPPED_DRAFTER_DIR))
    ap.add_argument("--dspark-draft", default=None, help="an SGLang DSpark checkpoint (default: see above)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--work-dir", default=None, help="server logs and the exported DSpark draft")
    args = ap.parse_args(argv)

    target = Path(args.target) if args.target else embedded_target_dir()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kv_budget_"))
    if args.dspark_draft:
        dspark, dspark_source = Path(args.dspark_draft), args.dspark_draft
    else:
        dspark, dspark_source = dspark_drafter_for(target, work / "dspark")
    cases = [("none", None), ("HSPEC", Path(args.hspec_draft)), ("DSPARK", dspark)]

    def layers(path: Path) -> int:
        return json.loads((path / "config.json").read_text())["num_hidden_layers"]

    rows = []
    for algo, draft in cases:
        spec = [] if draft is None else ["--speculative-algorithm", algo, "--speculative-draft-model-path", str(draft)]
        print(f"launching {algo} ...", flush=True)
        srv = server.launch(target, log_path=work / f"{algo}.log", args=spec, dtype=args.dtype,
                            plugins=("sglang_cpu_testing", "hspec"), max_total_tokens=None,
                            env_extra={"SGLANG_CPU_TESTING_KV_BUDGET_MB": str(args.budget_mb)})
        try:
            tokens = srv.get("/server_info")["max_total_num_tokens"]
        finally:
            srv.stop()  # one server at a time
        rows.append((algo, "-" if draft is None else f"{layers(draft)} layers", tokens))

    L_t, L_d = layers(target), layers(dspark)
    dspark_tokens = rows[-1][2]
    print(f"\ntarget {target.name} ({L_t} layers), --dtype {args.dtype}, KV budget {args.budget_mb:g} MiB "
          f"(SGLANG_CPU_TESTING_KV_BUDGET_MB), no --max-total-tokens")
    print(f"DSPARK drafter: {dspark_source}")
    print("\n| server | drafter | KV tokens | / DSPARK |")
    print("|---|---|---|---|")
    for algo, draft, tokens in rows:
        print(f"| {algo} | {draft} | {tokens} | {tokens / dspark_tokens:.4f} |")
    print(f"\nexpected HSPEC / DSPARK = (L_target + L_dspark) / L_target = ({L_t} + {L_d}) / {L_t} "
          f"= {(L_t + L_d) / L_t:.4f}")
    print("command: " + shlex.join([Path(sys.executable).name, "scripts/kv_budget.py", *(argv or sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
