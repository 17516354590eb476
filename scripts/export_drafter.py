"""Write a trained drafter checkpoint in the shipped form: its weights in bf16 (or another dtype) beside
its config.json, e.g. a `hspec train` checkpoint (fp32, 87.5 MB for the 21.9 M-parameter H-Spec drafter)
as `sglang_hspec/checkpoints/hspec-smollm2/` (bf16, 43.8 MB). The loader runs a bf16 checkpoint in the
target's dtype, so nothing else changes.

    python scripts/export_drafter.py runs/levers_regen/ship_regen/checkpoint-300/drafter \
        --out sglang_hspec/checkpoints/hspec-smollm2

Both files are written atomically (the weights last) by `write_checkpoint`, as `save_drafter` writes them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from sglang_hspec.model.checkpoint import read_checkpoint_config, read_checkpoint_weights, write_checkpoint

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_drafter(checkpoint: Path, out: Path, *, dtype: torch.dtype) -> Path:
    read_checkpoint_config(checkpoint)  # refuses a checkpoint whose config does not validate
    state = {name: (t.to(dtype) if t.is_floating_point() else t).contiguous()
             for name, t in read_checkpoint_weights(checkpoint).items()}
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        metadata = f.metadata() or {"format": "pt"}
    return write_checkpoint(out, state=state, metadata=metadata, config_text=(checkpoint / "config.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a drafter directory (config.json + model.safetensors)")
    ap.add_argument("--out", type=Path, required=True, help="directory to write (created if missing)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the floating-point weights")
    args = ap.parse_args(argv)
    for name in ("config.json", "model.safetensors"):
        if not (args.checkpoint / name).is_file():
            ap.error(f"{args.checkpoint / name} does not exist: pass a drafter directory, e.g. "
                     "runs/<run>/checkpoint-300/drafter")
    out = export_drafter(args.checkpoint, args.out, dtype=DTYPES[args.dtype])
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out}/model.safetensors ({size / 1e6:.1f} MB, {args.dtype}) and config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
