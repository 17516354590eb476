"""Run HERE (a machine with the package index and the prompt packages) before scripts/gpu_selfdistill.sh runs on a
lent GPU machine that reaches no index. Stages what that job needs beyond the machine's own torch / transformers,
within the device tool's 64 MiB per call (the tracked tree, with the shipped drafter, is ~46 MiB of it):

  .gpu/selfdistill/wheels/        this package's runtime dependencies the machine lacks (pydantic, msgspec, gguf,
                                  ...; the versions installed here, for CPython 3.12 manylinux x86-64);
  .gpu/selfdistill/prompts.jsonl.gz   the prompts to regenerate: the last --take records, in the order that
                                  `hspec data regenerate` processes them, of those not yet regenerated in any
                                  --done directory (a CPU regeneration resuming there works from the other end), cut
                                  to --max-turns user turns (later turns are never read);
  .gpu/selfdistill/eval_texts.json    `hspec data eval-texts`: the evaluation prompts to exclude, since the GPU
                                  machine lacks the prompt packages;
  .gpu/selfdistill/extra_train.jsonl.gz   --extra-train records trained on beside the new ones (optional);
  .gpu_gguf/partNN                the embedded target's GGUF in pieces of --part-mb, one per device call: each
                                  call carries one piece and copies it to /root/stash/ there (a carried path is
                                  removed again on the next call; files a command wrote stay while the machine
                                  stays warm, 30 s after a call).

    python scripts/gpu_stage_selfdistill.py --in data/smollm2_prompts/train.jsonl \
        --in data/smollm2_prompts/heldout.jsonl --done data/smollm2_regen_bf16 \
        --extra-train data/smollm2_regen_bf16/train.jsonl --take 9000
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from sglang_hspec.assets.embedded import embedded_gguf_path
from sglang_hspec.training.data import read_jsonl, write_evaluation_texts
from sglang_hspec.training.regenerate import order_key as regeneration_order_key
from sglang_hspec.training.regenerate import regenerated_ids

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ("annotated-types", "gguf", "msgspec", "pydantic", "pydantic_core", "typing-inspection", "typing_extensions")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def done_ids(done_dirs: list[Path]) -> set[str]:
    return set().union(*(regenerated_ids(d) for d in done_dirs))


def cut_turns(conversation: list[dict], max_turns: int) -> list[dict]:
    """The messages before the (max_turns + 1)-th user turn."""
    out, users = [], 0
    for message in conversation:
        users += message.get("role") == "user"
        if users > max_turns:
            break
        out.append(message)
    return out


def stage_prompts(in_paths: list[Path], done: set[str], *, take: int, max_turns: int, out: Path) -> int:
    records = {}
    for path in in_paths:
        for rec in read_jsonl(path):
            if rec.get("id") and rec["id"] not in done:
                records.setdefault(rec["id"], rec)
    chosen = sorted(records.values(), key=lambda r: regeneration_order_key(r["id"]))[-take:]
    with gzip.open(out, "wt", encoding="utf-8") as f:
        for rec in chosen:
            f.write(json.dumps({**rec, "conversations": cut_turns(rec["conversations"], max_turns)}) + "\n")
    return len(chosen)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in", dest="in_paths", action="append", required=True, type=Path, help="prompt JSONL (repeatable)")
    ap.add_argument("--done", action="append", default=[], type=Path,
                    help="a regenerate --out directory whose committed records are left out (repeatable)")
    ap.add_argument("--take", type=int, default=9000, help="prompts to stage")
    ap.add_argument("--max-turns", type=int, default=2, help="user turns kept per conversation")
    ap.add_argument("--extra-train", type=Path, default=None, help="training JSONL to carry along")
    ap.add_argument("--part-mb", type=float, default=17.0, help="GGUF piece size (MB)")
    args = ap.parse_args(argv)
    stage, gguf_dir = ROOT / ".gpu" / "selfdistill", ROOT / ".gpu_gguf"
    exclude = ROOT / ".git" / "info" / "exclude"
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    with open(exclude, "a") as f:
        f.writelines(f"{p}\n" for p in ("/.gpu/", "/.gpu_gguf/") if p not in lines)
    shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(gguf_dir, ignore_errors=True)
    (stage / "wheels").mkdir(parents=True)
    gguf_dir.mkdir()

    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platform_args, "-d",
                    str(stage / "wheels"), *pins], check=True)
    n = stage_prompts(args.in_paths, done_ids(args.done), take=args.take, max_turns=args.max_turns,
                      out=stage / "prompts.jsonl.gz")
    counts = write_evaluation_texts(stage / "eval_texts.json")
    if args.extra_train:
        with open(args.extra_train, "rb") as src, gzip.open(stage / "extra_train.jsonl.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    gguf = embedded_gguf_path()
    data, size = gguf.read_bytes(), int(args.part_mb * 1e6)
    parts = [data[i: i + size] for i in range(0, len(data), size)]
    for i, part in enumerate(parts):
        (gguf_dir / f"part{i:02d}").write_bytes(part)
    (stage / "gguf.json").write_text(json.dumps({"name": gguf.name, "sha256": hashlib.sha256(data).hexdigest(),
                                                  "parts": len(parts)}))
    staged = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file())
    print(json.dumps({"prompts": n, "eval_turns_per_set": counts, "wheels": pins, "gguf_parts": len(parts),
                      "selfdistill_mb": round(staged / 1e6, 1)}))
    print("then, on the device: one call per piece, carrying .gpu_gguf/partNN, running "
          "`mkdir -p /root/stash && cp .gpu_gguf/partNN /root/stash/`; then one call carrying .gpu: "
          "`bash scripts/gpu_selfdistill.sh`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
