"""`hspec data build | eval-texts | regenerate | merge | pack | unpack`: the command line over training/data.py
(building SpecForge JSONL), training/regenerate.py (self-distilled answers) and training/packed.py (compact
committed shards). Its own module so that neither of
those imports the other's command line: regenerate.py builds on data.py, never the reverse."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_hspec.training.data import (
    build_dataset,
    check_build_flags,
    code_records,
    evaluation_prompt_texts,
    math_records,
    sharegpt_records,
    write_evaluation_texts,
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("data", help="build / regenerate drafter training data (SpecForge JSONL layout)")
    sub = p.add_subparsers(dest="data_command", required=True)
    b = sub.add_parser("build", help="ShareGPT + Python source -> train.jsonl / heldout.jsonl")
    b.add_argument("--out", required=True, help="output directory")
    b.add_argument("--sharegpt", type=int, default=10000, help="ShareGPT conversations to read (0: none)")
    b.add_argument("--code", type=int, default=2000, help="Python source chunks to add (0: none)")
    b.add_argument("--math", type=int, default=0, help="MATH problems outside MATH-500 to add (0: none)")
    b.add_argument("--code-root", default=None, help="directory of .py files (default: the stdlib)")
    b.add_argument("--heldout", type=float, default=0.02, help="held-out fraction (split by id hash)")
    add_eval_texts_argument(b)
    b.set_defaults(func=run_cli)
    e = sub.add_parser("eval-texts", help="write the evaluation prompt sets' turns (what build and regenerate "
                                          "exclude) to one file, for a machine without the prompt packages")
    e.add_argument("--out", required=True, help="output JSON file")
    e.set_defaults(func=run_cli)
    r = sub.add_parser("regenerate", help="rewrite assistant turns with the target (our engine, or a running "
                                          "server with --server), batched and resumable")
    from sglang_hspec.training.regenerate import add_arguments

    add_arguments(r)
    add_eval_texts_argument(r)
    r.set_defaults(func=run_cli)
    m = sub.add_parser("merge", help="train.jsonl / heldout.jsonl from the shards a regenerate run has committed "
                                     "so far (after a kill, or a snapshot while it runs)")
    m.add_argument("--out", required=True, help="the --out directory of `hspec data regenerate`")
    m.add_argument("--heldout", type=float, default=0.02,
                   help="held-out fraction (split by id hash): the one the regenerate run used")
    m.set_defaults(func=run_cli)
    pack = sub.add_parser("pack", help="a regenerate --out directory (or a SpecForge JSONL) -> compact committed shards "
                                    "(uint16 token ids, loss-mask bits, manifest) that `hspec train` reads directly")
    pack.add_argument("--in", dest="in_path", required=True,
                   help="the --out directory of `hspec data regenerate` (one packed shard per committed shard) or a "
                        "SpecForge JSONL file")
    pack.add_argument("--out", required=True, help="packed directory (manifest.json + NNNNNN.npz); shards already "
                                                "packed from the same source are kept")
    pack.add_argument("--target", default="embedded", help="the target whose tokenizer renders the conversations")
    pack.add_argument("--heldout", type=float, default=0.02, help="held-out fraction (split by id hash)")
    pack.add_argument("--prompts", default=None, help="the `hspec data build --out` directory the prompts came from "
                                                   "(its build_stats.json goes into the manifest)")
    pack.add_argument("--prompts-command", default=None, help="the `hspec data build` command, for the manifest")
    pack.set_defaults(func=run_cli)
    u = sub.add_parser("unpack", help="a packed directory -> SpecForge JSONL (train.jsonl / heldout.jsonl)")
    u.add_argument("--in", dest="in_path", required=True, help="packed directory (with manifest.json)")
    u.add_argument("--out", required=True, help="output directory")
    u.add_argument("--target", default="embedded", help="the target whose tokenizer decodes the ids")
    u.add_argument("--shards", action="store_true",
                   help="also write the regenerate directory layout (shards/), so that rerunning the set's "
                        "regenerate command with this --out resumes after the packed shards")
    u.set_defaults(func=run_cli)
    return p


def add_eval_texts_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eval-texts", default=None,
                        help="file of `hspec data eval-texts`: the evaluation prompts to exclude, where the prompt "
                             "packages are not installed (default: read from those packages)")


def run_cli(args) -> int:
    if args.data_command == "eval-texts":
        counts = write_evaluation_texts(args.out)
        print(json.dumps({"out": args.out, "turns_per_set": counts}))
        return 0
    if args.data_command == "build":
        check_build_flags(args)

        def records():
            if args.sharegpt:
                yield from sharegpt_records(limit=args.sharegpt)
            if args.code:
                yield from code_records(limit=args.code, root=args.code_root)
            if args.math:
                yield from math_records(limit=args.math)

        stats = build_dataset(records=records(), out_dir=args.out, heldout_fraction=args.heldout,
                              exclude_texts=evaluation_prompt_texts(args.eval_texts))
        print(json.dumps(stats.__dict__))
        return 0
    if args.data_command == "merge":
        import msgspec

        from sglang_hspec.training.regenerate import merge

        print(json.dumps(msgspec.structs.asdict(merge(args.out, heldout_fraction=args.heldout))))
        return 0
    if args.data_command in ("pack", "unpack"):
        return _run_pack(args)
    if args.server is not None:
        from sglang_hspec.training.server_regenerate import run_server_cli

        return run_server_cli(args)
    from sglang_hspec.training.regenerate import run_cli as run_regenerate

    return run_regenerate(args)


def check_pack_flags(args):
    """`hspec data pack | unpack`'s --in, --heldout and --out, checked before the tokenizer loads and before
    anything is written (--out is created only when the data is written). Returns unpack's manifest."""
    from sglang_hspec.training import packed
    from sglang_hspec.training.config import output_dir_problem

    manifest = None
    if args.data_command == "unpack":
        manifest = packed.read_manifest(args.in_path)  # a missing or foreign manifest names its file
    else:
        packed.check_pack_input(in_path=args.in_path, out_dir=args.out, heldout_fraction=args.heldout)
    problem = output_dir_problem(args.out)
    if problem is not None:
        raise OSError(f"--out {args.out} cannot be created: {problem}; pick another --out")
    return manifest


def _run_pack(args) -> int:
    from sglang_hspec.target.loading import load_tokenizer
    from sglang_hspec.training import packed
    from sglang_hspec.training.data import tokenizer_fingerprint

    manifest = check_pack_flags(args)
    tokenizer = load_tokenizer(args.target)
    if args.data_command == "unpack":
        if tokenizer_fingerprint(tokenizer) != manifest.tokenizer_fingerprint:
            raise ValueError(f"--target {args.target}: its tokenizer is not the one {args.in_path} was packed with "
                             f"(fingerprint {manifest.tokenizer_fingerprint}, target {manifest.target!r}), so its "
                             f"ids would decode to other text; pass --target {manifest.target}")
        print(json.dumps({"out": args.out, "records": packed.unpack(path=args.in_path, out_dir=args.out,
                                                                    tokenizer=tokenizer, shards=args.shards)}))
        return 0
    manifest = packed.pack(in_path=args.in_path, out_dir=args.out, tokenizer=tokenizer, target=args.target,
                           heldout_fraction=args.heldout,
                           prompt_sources=packed.prompt_sources_of(args.prompts, args.prompts_command))
    size = sum((Path(args.out) / s.file).stat().st_size for s in manifest.shards)
    print(json.dumps({"out": args.out, "shards": len(manifest.shards), "conversations": manifest.conversations,
                      "tokens": manifest.tokens, "target_tokens": manifest.target_tokens,
                      "heldout": len(manifest.heldout_ids), "bytes": size}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_hspec.training.data_cli")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
