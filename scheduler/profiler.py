"""SPS profiler: steps/s of a verify forward over a range of batch-token sizes.

The engine provides `step_fn(batch_tokens)`, which runs one target verify forward of that many tokens
(B requests x (1 + l) tokens) and returns when it has finished (call the device's synchronise inside
it on GPU). Per probe: `warmup` untimed steps, then `repeats` timed runs of `steps_per_repeat` steps;
SPS = 1 / median(per-step time over the repeats). The result is SGLang's `SpsCostTable` JSON.

For the speculate-or-decode switch (scheduler/switch.py) the same run can measure, at each of
`plain_batch_sizes` requests, a plain decode step (`plain_fn(num_reqs)`: one token per request, no
drafter) and the drafter's propose forward (`draft_fn(num_reqs)`), into the table's `plain_steps_per_sec`
and `draft_seconds` columns (which SGLang's loader ignores). A step function may carry them as
attributes `step_fn.plain_fn` / `step_fn.draft_fn`; the CLI then profiles them (`--plain-batch-sizes`).

CLI (`hspec profile-sps`, meanwhile `python -m sglang_hspec.scheduler.profiler`): the step function is
named as MODULE:FACTORY, a callable `factory(max_batch_tokens=..., tokens_per_request=...)` returning
`step_fn` (e.g. `sglang_hspec.engine.profile:make_step_fn`, the reference engine's target, which `hspec profile-sps` uses by default).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from .sps import SpsCostTable, save_sps_table


def _probe_sizes(name: str, sizes: list[int]) -> list[int]:
    if not sizes:
        raise ValueError(f"{name} is empty: give at least two probe sizes (e.g. 1,2,4,8,...)")
    probes = sorted(int(b) for b in sizes)
    if probes[0] < 1:
        raise ValueError(f"{name} must be >= 1, got {probes[0]}")
    if len(set(probes)) != len(probes):
        raise ValueError(f"{name} has duplicates ({sizes}); each size is one probe")
    return probes


def profile_sps(
    *,
    step_fn: Callable[[int], None],
    batch_tokens: list[int],
    warmup: int = 3,
    repeats: int = 5,
    steps_per_repeat: int = 4,
    max_batch_tokens: int | None = None,
    plain_fn: Callable[[int], None] | None = None,
    draft_fn: Callable[[int], None] | None = None,
    plain_batch_sizes: list[int] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    progress: bool = True,
) -> SpsCostTable:
    probes = _probe_sizes("batch_tokens", batch_tokens)
    if warmup < 0 or repeats < 1 or steps_per_repeat < 1:
        raise ValueError(f"need warmup >= 0, repeats >= 1, steps_per_repeat >= 1; got "
                         f"{warmup}, {repeats}, {steps_per_repeat}")
    if draft_fn is not None and plain_fn is None:
        raise ValueError("draft_fn needs plain_fn too: the drafter's cost only matters against plain decoding")
    sizes = _probe_sizes("plain_batch_sizes", plain_batch_sizes or []) if plain_fn is not None else []

    def seconds_per_call(fn: Callable[[int], None], size: int, what: str) -> float:
        for _ in range(warmup):
            fn(size)
        per_step = []
        for _ in range(repeats):
            start = clock()
            for _ in range(steps_per_repeat):
                fn(size)
            per_step.append((clock() - start) / steps_per_repeat)
        median = statistics.median(per_step)
        if median <= 0:
            raise ValueError(f"{what}({size}) took no measurable time; is it running the forward?")
        return median

    work = [("verify", bt) for bt in probes] + [("plain", n) for n in sizes]
    work += [("draft", n) for n in sizes] if draft_fn is not None else []
    fns = {"verify": step_fn, "plain": plain_fn, "draft": draft_fn}
    measured: dict[str, list[float]] = {"verify": [], "plain": [], "draft": []}
    for kind, size in tqdm(work, desc="profile-sps", unit="probe", disable=not progress):
        measured[kind].append(seconds_per_call(fns[kind], size, f"{kind}_fn" if kind != "verify" else "step_fn"))
    return SpsCostTable(sample_batch_tokens=probes, sample_steps_per_sec=[1.0 / t for t in measured["verify"]],
                        max_batch_tokens=max(max_batch_tokens or probes[-1], probes[-1]),
                        plain_batch_sizes=sizes, plain_steps_per_sec=[1.0 / t for t in measured["plain"]],
                        draft_seconds=measured["draft"])


def plot_sps(table: SpsCostTable, path: str | Path, *, title: str = "Verify steps/s vs batch tokens") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(table.sample_batch_tokens) + [table.max_batch_tokens]
    ys = list(table.sample_steps_per_sec) + [table.sample_steps_per_sec[-1]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.step(xs, ys, where="post", label="verify: floor table (planner lookup)")
    ax.plot(table.sample_batch_tokens, table.sample_steps_per_sec, "o", label="verify probes")
    if table.plain_batch_sizes:
        ax.plot(table.plain_batch_sizes, table.plain_steps_per_sec, "s--", label="plain decode (x = requests)")
    if table.draft_seconds:
        ax.plot(table.plain_batch_sizes, [1.0 / max(t, 1e-12) for t in table.draft_seconds], "^:",
                label="drafter forwards/s (x = requests)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch tokens B = sum_r (1 + verify_length_r)")
    ax.set_ylabel("steps / s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_factory(spec: str) -> Callable:
    """MODULE:NAME or path/to/file.py:NAME."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"--step-fn must look like MODULE:FACTORY or path/to/file.py:FACTORY, got {spec!r}")
    if mod_name.endswith(".py"):
        if not Path(mod_name).is_file():
            raise ValueError(f"--step-fn file {mod_name} does not exist")
        spec_obj = importlib.util.spec_from_file_location(Path(mod_name).stem, mod_name)
        module = importlib.util.module_from_spec(spec_obj)
        spec_obj.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    if not hasattr(module, attr):
        raise ValueError(f"--step-fn: {mod_name} has no attribute {attr!r}")
    return getattr(module, attr)


def int_at_least(low: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`; `what` (what the flag counts) goes into the error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low} ({what}), got {text!r}")
        return value
    return parse


def finite_at_least(low: float, what: str, *, above: bool = False,
                    at_most: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number >= `low` (> `low` with `above`), and <= `at_most` if given. nan and
    inf are refused: a probe waiting for inf seconds, or compared against nan, never ends."""
    bound = f"> {low:g}" if above else f">= {low:g}"
    bound += "" if at_most is None else f" and <= {at_most:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if (not math.isfinite(value) or value < low or (above and value == low)
                or (at_most is not None and value > at_most)):
            raise argparse.ArgumentTypeError(f"expected a finite number {bound} ({what}), got {text!r}")
        return value
    return parse


def probe_sizes_list(what: str) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated probe sizes, each >= 1, at least one."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what} >= 1, e.g. 1,2,4,8, got {text!r}")
        return values
    return parse


def _factory_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--factory-arg must look like KEY=VALUE, got {text!r}")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def add_parser(subparsers, *, step_fn_factory: Callable | None = None) -> argparse.ArgumentParser:
    """Register `profile-sps`. An engine may pass its own `step_fn_factory` as the default."""
    p = subparsers.add_parser("profile-sps", help="measure verify steps/s vs batch tokens -> SPS table JSON")
    p.add_argument("--step-fn", default=None,
                   help="MODULE:FACTORY or file.py:FACTORY returning step_fn(batch_tokens)"
                        + ("" if step_fn_factory is None else " (default: the reference engine's target)"))
    p.add_argument("--batch-tokens", type=probe_sizes_list("batch tokens"), default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                   help="comma-separated probe sizes (default 1,2,4,...,512: batch-1 serving verifies 1..8)")
    p.add_argument("--plain-batch-sizes", type=probe_sizes_list("request counts"), default=[1, 2, 4, 8, 16, 32, 64],
                   help="requests at which plain decode steps and the drafter are timed, when the step "
                        "function provides plain_fn / draft_fn (default 1,2,...,64)")
    p.add_argument("--tokens-per-request", type=int_at_least(1, "verify tokens per request: 1 + block_size"),
                   default=8, help="1 + block_size verify tokens per request")
    p.add_argument("--factory-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra keyword for the step-fn factory (repeatable), e.g. target=/models/Qwen3-8B")
    p.add_argument("--max-batch-tokens", type=int_at_least(1, "the engine's verify capacity in tokens"), default=None,
                   help="engine verify capacity")
    p.add_argument("--warmup", type=int_at_least(0, "untimed steps per probe"), default=3)
    p.add_argument("--repeats", type=int_at_least(1, "timed runs per probe"), default=5)
    p.add_argument("--steps-per-repeat", type=int_at_least(1, "steps per timed run"), default=4)
    p.add_argument("--out", required=True, help="SPS table JSON path (a PNG is written next to it)")
    p.set_defaults(func=run_profile_sps, step_fn_factory=step_fn_factory)
    return p


def run_profile_sps(args: argparse.Namespace) -> int:
    if args.step_fn:
        factory = load_factory(args.step_fn)
    elif getattr(args, "step_fn_factory", None) is not None:
        factory = args.step_fn_factory
    else:
        raise SystemExit("profile-sps: give --step-fn MODULE:FACTORY (e.g. sglang_hspec.engine.profile:make_step_fn)")
    max_bt = args.max_batch_tokens or max(args.batch_tokens)
    extra = dict(_factory_arg(a) for a in args.factory_arg)
    if "max_requests" in inspect.signature(factory).parameters and "max_requests" not in extra:
        extra["max_requests"] = max(args.plain_batch_sizes)  # rows for the plain / draft probes
    step_fn = factory(max_batch_tokens=max_bt, tokens_per_request=args.tokens_per_request, **extra)
    table = profile_sps(step_fn=step_fn, batch_tokens=args.batch_tokens, warmup=args.warmup,
                        repeats=args.repeats, steps_per_repeat=args.steps_per_repeat, max_batch_tokens=max_bt,
                        plain_fn=getattr(step_fn, "plain_fn", None), draft_fn=getattr(step_fn, "draft_fn", None),
                        plain_batch_sizes=args.plain_batch_sizes)
    out = Path(args.out)
    save_sps_table(table, out)
    plot_sps(table, out.with_suffix(".png"))
    for bt, s in zip(table.sample_batch_tokens, table.sample_steps_per_sec):
        print(f"{bt:>7d} tokens  {s:10.2f} verify steps/s")
    for i, n in enumerate(table.plain_batch_sizes):
        draft = f"  draft {table.draft_seconds[i] * 1e3:8.2f} ms" if table.draft_seconds else ""
        print(f"{n:>7d} requests {table.plain_steps_per_sec[i]:10.2f} plain steps/s{draft}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_hspec.scheduler.profiler")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["profile-sps", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
