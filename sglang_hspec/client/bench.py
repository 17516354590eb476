"""Closed-loop serving benchmark: ``hspec bench serve`` (or ``python -m sglang_hspec.client.bench``).

For each concurrency C, C simulated users each take the next conversation from the prompt set and
send its turns one after another (a turn's request includes the earlier turns and answers), so
exactly C requests are in flight until the set runs out. Per concurrency it reports output
throughput, per-user tokens/s (p50/p90 of completion tokens / request wall time), tau (tokens per
verify step, over all requests) and wasted verify tokens. ``--compare`` runs several servers one
after another and puts them in one table, with throughput relative to the baseline server. With
``--rounds R`` each concurrency level runs R rounds, and each round drives every server in turn (odd
rounds in reverse order), so that the machine's drift reaches all servers alike and none always runs
first or right after the same server; a row pools its rounds (tokens over wall time), and
the table adds the range of the per-round ratios to the baseline (each measured in the same round).

Example::

    python -m sglang_hspec.client.bench --prompts mtbench --concurrency 1,4,16,64 \\
        --compare HSPEC=http://127.0.0.1:30000 DSPARK=http://127.0.0.1:30001 \\
        baseline=http://127.0.0.1:30002 --out runs/bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np
from tqdm import tqdm

from sglang_hspec.core.atomic import atomic_write_text

from .client import AsyncHSpecClient, checked_base_url
from .errors import HSpecClientError, InvalidArgumentError, ServerUnavailableError


class Conversation(msgspec.Struct, frozen=True):
    """A prompt-set item: user turns sent in order."""

    id: str
    turns: tuple[str, ...]


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    conversation_id: str
    turn: int
    completion_tokens: int
    latency_s: float
    verify_ct: int | None = None
    wasted_verify_tokens: int | None = None
    error: str | None = None


class LevelSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One server at one concurrency. Rates are per second of wall time."""

    server: str
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    output_tokens: int
    throughput_tok_s: float
    per_user_tok_s_p50: float | None
    per_user_tok_s_p90: float | None
    latency_s_p50: float | None
    latency_s_p90: float | None
    tau: float | None
    verify_steps: int
    wasted_verify_tokens: int
    wasted_verify_per_token: float | None
    first_error: str | None = None
    round_throughputs: tuple[float, ...] = ()  # tok/s of each round, in order (--rounds)


# ---------------------------------------------------------------------------------------------------
# Prompt sets


def load_conversations(spec: str, *, limit: int | None = None) -> list[Conversation]:
    """A JSONL file of ``{"id", "turns"}``, or a named set from ``sglang_hspec.assets.prompts``."""
    path = Path(spec)
    if path.suffix in (".jsonl", ".json") or path.exists():
        if not path.is_file():
            raise SystemExit(
                f"--prompts {spec}: no such file; pass a JSONL file of {{id, turns}} or a set name"
            )
        convs = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = msgspec.json.decode(line)
                turns = item["turns"]
                if isinstance(turns, str):
                    turns = [turns]
                if not turns or not all(isinstance(t, str) and t for t in turns):
                    raise ValueError("turns must be a non-empty list of non-empty strings")
                convs.append(Conversation(id=str(item.get("id", lineno)), turns=tuple(turns)))
            except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
                raise SystemExit(
                    f'--prompts {spec}, line {lineno}: expected {{"id": ..., "turns": [str, ...]}} ({exc})'
                ) from None
        convs = convs[:limit] if limit else convs
    else:
        try:
            from sglang_hspec.assets.prompts import load_prompts
        except ImportError:
            raise SystemExit(
                f"--prompts {spec}: named prompt sets need sglang_hspec.assets.prompts, which this install "
                "lacks; pass a JSONL file of {id, turns} instead"
            ) from None
        items = load_prompts(spec, limit=limit)
        convs = [
            Conversation(id=str(getattr(item, "id", i)), turns=tuple(item.turns))
            for i, item in enumerate(items)
        ]
    if not convs:
        raise SystemExit(f"--prompts {spec}: the prompt set is empty")
    return convs


# ---------------------------------------------------------------------------------------------------
# Load generation


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(
    server: str,
    concurrency: int,
    records: Sequence[RequestRecord],
    wall_s: float,
    *,
    round_throughputs: Sequence[float] = (),
) -> LevelSummary:
    """Aggregate one level (all its rounds: wall_s is their sum). tau = total tokens / total verify
    steps, over requests that report them."""
    ok = [r for r in records if r.error is None]
    errors = [r for r in records if r.error is not None]
    out_tokens = sum(r.completion_tokens for r in ok)
    speeds = [r.completion_tokens / r.latency_s for r in ok if r.latency_s > 0]
    latencies = [r.latency_s for r in ok]
    spec = [r for r in ok if r.verify_ct]
    verify_steps = sum(r.verify_ct for r in spec)
    spec_tokens = sum(r.completion_tokens for r in spec)
    wasted = sum(r.wasted_verify_tokens or 0 for r in spec)
    return LevelSummary(
        server=server,
        concurrency=concurrency,
        requests=len(records),
        errors=len(errors),
        wall_s=wall_s,
        output_tokens=out_tokens,
        throughput_tok_s=out_tokens / wall_s if wall_s > 0 else 0.0,
        per_user_tok_s_p50=_percentile(speeds, 50),
        per_user_tok_s_p90=_percentile(speeds, 90),
        latency_s_p50=_percentile(latencies, 50),
        latency_s_p90=_percentile(latencies, 90),
        tau=spec_tokens / verify_steps if verify_steps else None,
        verify_steps=verify_steps,
        wasted_verify_tokens=wasted,
        wasted_verify_per_token=wasted / spec_tokens if spec_tokens else None,
        first_error=errors[0].error if errors else None,
        round_throughputs=tuple(round_throughputs),
    )


async def _run_conversation(
    client: AsyncHSpecClient,
    conv: Conversation,
    *,
    api: str,
    max_tokens: int,
    temperature: float,
    ignore_eos: bool,
) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    history: list[dict[str, str]] = []
    for turn, text in enumerate(conv.turns):
        history.append({"role": "user", "content": text})
        try:
            if api == "chat":
                extra = {"ignore_eos": True} if ignore_eos else None
                r = await client.chat(
                    history, max_tokens=max_tokens, temperature=temperature, extra_body=extra
                )
                latency = r.latency_s
            else:
                # Native /generate has no chat template: the conversation so far, as plain text.
                prompt = "\n\n".join(m["content"] for m in history)
                r = await client.generate(
                    prompt, max_new_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos
                )
                latency = r.client_latency_s  # what the user waits, as for chat
        except ServerUnavailableError:
            raise  # the server is gone: stop the run instead of recording a wall of failures
        except HSpecClientError as exc:
            records.append(
                RequestRecord(
                    conversation_id=conv.id, turn=turn, completion_tokens=0, latency_s=0.0, error=str(exc)
                )
            )
            return records  # later turns would build on a missing answer
        history.append({"role": "assistant", "content": r.text})
        records.append(
            RequestRecord(
                conversation_id=conv.id,
                turn=turn,
                completion_tokens=r.completion_tokens,
                latency_s=latency,
                verify_ct=r.spec.verify_ct if r.spec else None,
                wasted_verify_tokens=r.spec.wasted_verify_tokens if r.spec else None,
            )
        )
    return records


async def run_level(
    url: str,
    conversations: Sequence[Conversation],
    *,
    concurrency: int,
    api: str = "chat",
    max_tokens: int = 256,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    timeout: float = 600.0,
    on_request: Callable[[int], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Closed loop: ``concurrency`` users drain ``conversations``; returns the records and the wall time."""
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for conv in conversations:
        queue.put_nowait(conv)
    records: list[RequestRecord] = []

    async def user(client: AsyncHSpecClient) -> None:
        while True:
            try:
                conv = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            recs = await _run_conversation(
                client, conv, api=api, max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos
            )
            records.extend(recs)
            if on_request is not None:
                on_request(len(recs))

    async with AsyncHSpecClient(url, timeout=timeout, max_connections=max(concurrency, 1)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(user(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return records, wall


def conversations_for_level(conversations: Sequence[Conversation], concurrency: int) -> list[Conversation]:
    """The whole set, repeated (ids suffixed) until every user has at least two conversations."""
    n = max(len(conversations), 2 * concurrency)
    out = list(conversations)
    for i in range(len(conversations), n):
        conv = conversations[i % len(conversations)]
        out.append(Conversation(id=f"{conv.id}#{i // len(conversations)}", turns=conv.turns))
    return out


# ---------------------------------------------------------------------------------------------------
# Reporting


def format_table(summaries: Sequence[LevelSummary], baseline: str | None) -> str:
    base = {s.concurrency: s for s in summaries if s.server == baseline}
    rounds = max((len(s.round_throughputs) for s in summaries), default=1)
    header = (
        f"{'server':<12} {'conc':>5} {'reqs':>5} {'err':>4} {'out tok/s':>10} {'vs base':>8} "
        f"{'user p50':>9} {'user p90':>9} {'tau':>6} {'wasted/tok':>10}"
        + (f" {'vs base by round':>18}" if rounds > 1 else "")
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        ref = base.get(s.concurrency)
        ratio = f"{s.throughput_tok_s / ref.throughput_tok_s:.2f}x" if ref and ref.throughput_tok_s else "-"
        tau = f"{s.tau:.2f}" if s.tau is not None else "-"
        wasted = f"{s.wasted_verify_per_token:.2f}" if s.wasted_verify_per_token is not None else "-"
        p50, p90 = (
            f"{v:.1f}" if v is not None else "-" for v in (s.per_user_tok_s_p50, s.per_user_tok_s_p90)
        )
        spread = ""
        if rounds > 1:
            per_round = [
                a / b for a, b in zip(s.round_throughputs, ref.round_throughputs if ref else ()) if b > 0
            ]
            spread = f" {f'{min(per_round):.2f}-{max(per_round):.2f}x' if per_round else '-':>18}"
        lines.append(
            f"{s.server:<12} {s.concurrency:>5} {s.requests:>5} {s.errors:>4} {s.throughput_tok_s:>10.1f} "
            f"{ratio:>8} {p50:>9} {p90:>9} {tau:>6} {wasted:>10}{spread}"
        )
    return "\n".join(lines)


def figure(summaries: Sequence[LevelSummary]):
    """The three panels of bench_serve.png. Each server keeps one colour in every panel (the legend is drawn on
    the first only), including the tau panel, where a server without speculation has no line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    servers = list(dict.fromkeys(s.server for s in summaries))
    colours = {server: f"C{i % 10}" for i, server in enumerate(servers)}
    panels = [
        ("throughput_tok_s", "output throughput (tok/s)"),
        ("per_user_tok_s_p50", "per-user tok/s (p50)"),
        ("tau", "tau (tokens / verify step)"),
    ]
    for ax, (field, title) in zip(axes, panels):
        for server in servers:
            pts = [(s.concurrency, getattr(s, field)) for s in summaries if s.server == server]
            pts = [(c, v) for c, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=server, color=colours[server])
        ax.set_xscale("log", base=2)
        levels = sorted({s.concurrency for s in summaries})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    return fig


def plot(summaries: Sequence[LevelSummary], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(summaries)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replot(json_path: Path) -> Path:
    """Redraw bench_serve.png beside a committed bench_serve.json from its rows."""
    rows = msgspec.json.decode(Path(json_path).read_bytes())["results"]
    out = Path(json_path).with_suffix(".png")
    plot([msgspec.convert(r, LevelSummary) for r in rows], out)
    return out


# ---------------------------------------------------------------------------------------------------
# CLI


def _parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--concurrency wants integers like 1,4,16,64, got {text!r}"
        ) from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError(
            f"--concurrency wants positive integers like 1,4,16,64, got {text!r}"
        )
    return levels


def _parse_rounds(text: str) -> int:
    try:
        rounds = int(text)
    except ValueError:
        rounds = 0
    if rounds < 1:
        raise argparse.ArgumentTypeError(f"--rounds wants a positive integer, got {text!r}")
    return rounds


def _checked_url(flag: str, url: str) -> str:
    try:
        return checked_base_url(url)
    except InvalidArgumentError as exc:
        raise SystemExit(f"{flag}: {exc}") from None


def _parse_servers(args: argparse.Namespace) -> list[tuple[str, str]]:
    if bool(args.url) == bool(args.compare):
        raise SystemExit("pass exactly one of --url URL or --compare NAME=URL [NAME=URL ...]")
    if args.url:
        return [("server", _checked_url("--url", args.url))]
    servers = []
    for item in args.compare:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise SystemExit(f"--compare wants NAME=http://HOST:PORT items, got {item!r}")
        servers.append((name, _checked_url(f"--compare {name}=", url)))
    if len({n for n, _ in servers}) != len(servers):
        raise SystemExit(f"--compare names must be distinct, got {[n for n, _ in servers]}")
    return servers


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``serve`` under a ``bench`` subcommand group; the handler is ``args.func``."""
    p = subparsers.add_parser("serve", help="closed-loop serving benchmark against SGLang servers")
    configure_parser(p)
    return p


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="one server, e.g. http://127.0.0.1:30000")
    p.add_argument("--compare", nargs="+", metavar="NAME=URL", help="several servers, run one after another")
    p.add_argument(
        "--baseline", help="server name that 'vs base' divides by (default: the last --compare name)"
    )
    p.add_argument(
        "--prompts", required=True, help="a prompt set name (e.g. mtbench) or a JSONL file of {id, turns}"
    )
    p.add_argument("--limit", type=int, default=None, help="use the first N conversations of the set")
    p.add_argument("--concurrency", type=_parse_concurrency, default=[1, 4, 16, 64], help="e.g. 1,4,16,64")
    p.add_argument(
        "--api", choices=("chat", "generate"), default="chat", help="endpoint (chat applies the template)"
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds without data before a request fails")
    p.add_argument(
        "--rounds", type=_parse_rounds, default=1,
        help="rounds per concurrency level; each round drives every server in turn, odd rounds in reverse (default 1)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench_serve"), help="folder for bench_serve.json/.png")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    servers = _parse_servers(args)
    baseline = args.baseline or (servers[-1][0] if len(servers) > 1 else None)
    if baseline is not None and baseline not in {n for n, _ in servers}:
        raise SystemExit(
            f"--baseline {baseline!r} is not one of the --compare names {[n for n, _ in servers]}"
        )
    conversations = load_conversations(args.prompts, limit=args.limit)
    summaries: list[LevelSummary] = []
    server_info: dict[str, dict] = {}
    for name, url in servers:
        server_info[name] = {"url": url, **asyncio.run(_server_info(url))}
    for concurrency in args.concurrency:
        convs = conversations_for_level(conversations, concurrency)
        total = sum(len(c.turns) for c in convs)
        records: dict[str, list[RequestRecord]] = {name: [] for name, _ in servers}
        walls: dict[str, list[float]] = {name: [] for name, _ in servers}
        rates: dict[str, list[float]] = {name: [] for name, _ in servers}
        # round-major: every server runs once per round, so slow drift of the machine reaches all alike;
        # odd rounds run in reverse, so no server always runs right after the same one (or always first)
        for round_index in range(args.rounds):
            for name, url in servers if round_index % 2 == 0 else servers[::-1]:
                label = f"{name} c={concurrency}" + (
                    f" round {round_index + 1}/{args.rounds}" if args.rounds > 1 else ""
                )
                with tqdm(total=total, desc=label, unit="req", file=sys.stderr) as bar:
                    try:
                        level_records, wall = asyncio.run(
                            run_level(
                                url,
                                convs,
                                concurrency=concurrency,
                                api=args.api,
                                max_tokens=args.max_tokens,
                                temperature=args.temperature,
                                ignore_eos=args.ignore_eos,
                                timeout=args.timeout,
                                on_request=bar.update,
                            )
                        )
                    except ServerUnavailableError as exc:
                        raise SystemExit(f"{name}: {exc}") from None
                one_round = summarize(name, concurrency, level_records, wall)
                if one_round.errors == one_round.requests:
                    raise SystemExit(
                        f"{name} at concurrency {concurrency}: every request failed: {one_round.first_error}"
                    )
                records[name] += level_records
                walls[name].append(wall)
                rates[name].append(one_round.throughput_tok_s)
        for name, _ in servers:
            summaries.append(
                summarize(name, concurrency, records[name], sum(walls[name]), round_throughputs=rates[name])
            )
    print(format_table(summaries, baseline))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {
            "prompts": args.prompts,
            "conversations": len(conversations),
            "concurrency": args.concurrency,
            "api": args.api,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "baseline": baseline,
            "rounds": args.rounds,
        },
        "servers": server_info,
        "results": msgspec.to_builtins(summaries),
    }
    json_path, png_path = args.out / "bench_serve.json", args.out / "bench_serve.png"
    # Atomic: a reader never sees half a report, and an interrupted run keeps the previous one.
    atomic_write_text(json_path, json.dumps(report, indent=2, allow_nan=False))
    plot(summaries, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


async def _server_info(url: str) -> dict:
    async with AsyncHSpecClient(url, timeout=30.0) as client:
        try:
            info = await client.server_info()
        except ServerUnavailableError as exc:
            raise SystemExit(str(exc)) from None
        except HSpecClientError:
            return {"speculative_algorithm": None, "server_info": "unavailable"}
    return {
        "speculative_algorithm": info.speculative_algorithm,
        "speculative_num_draft_tokens": info.speculative_num_draft_tokens,
        "version": info.version,
        "model_path": info.model_path,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hspec bench serve", description=__doc__.split("\n\n")[0])
    configure_parser(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
