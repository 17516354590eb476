"""Where an HSPEC decode step's time goes inside SGLang: wall-clock segments behind an env flag.

`HSPEC_STEP_PROFILE=<path.json>` in a server's environment makes the HSPEC worker time each decode step
with `time.perf_counter` and rewrite `<path.json>` (atomically) after every step with cumulative totals:

- per step kind (`draft`: the drafter ran; `plain`: a no-draft step, see speculation_switch.py): the
  number of steps and the seconds per segment;
- segments (nested names use dots; a parent includes its children): `step` (the worker's
  `forward_batch_generation`), `draft` (DSpark's proposer: the drafter's runner forward and heads),
  `draft.forward` (the draft model runner, SGLang's batch setup included), `draft.model` (our
  `HSpecDraftModel.forward`), `draft.kv_view` (the target-KV window view and gather inside it),
  `draft.base_logits` (our draft-vocabulary logits, laid out over the target vocabulary),
  `draft.markov` (SGLang's Markov draft sampler, `sample_draft_block`), `draft.confidence` (the
  confidence head),
  `planner` (SGLang's budget resolution and layout, our planner hooks inside), `verify` (the target's
  verify forward and SGLang's scatter), `accept`, `commit` (our context-row write), `loop` (from the end
  of one decode step to the start of the next: SGLang's scheduler, output processing, and the
  stale-budget preparation `prepare` inside it).

A step is on the host here (CPU tier: the forward is synchronous), so wall time is the cost. On a GPU
the segments measure launch time only. `scripts/profile_sglang_step.py` reads the file. Pure Python: no
SGLang import.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from functools import wraps
from pathlib import Path

from sglang_hspec.core.atomic import atomic_write_text

ENV = "HSPEC_STEP_PROFILE"
STEP_KINDS = ("draft", "plain")


class StepTimer:
    """Cumulative wall-clock seconds per (step kind, segment), written to `path` after each step."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.totals: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind in STEP_KINDS}
        self.steps: dict[str, int] = dict.fromkeys(STEP_KINDS, 0)
        self._current: dict[str, float] | None = None
        self._kind = "draft"
        self._last_step_end: float | None = None
        self._pending_loop = 0.0
        self._pending_prepare = 0.0

    @classmethod
    def from_env(cls, environ=None) -> StepTimer | None:
        path = step_profile_path(environ)
        return cls(path) if path is not None else None

    # ---- a decode step ----
    def begin_step(self, *, kind: str) -> None:
        if kind not in STEP_KINDS:
            raise ValueError(f"step kind must be one of {STEP_KINDS}, got {kind!r}")
        now = time.perf_counter()
        self._kind = kind
        self._current = defaultdict(float)
        if self._last_step_end is not None:
            self._pending_loop = now - self._last_step_end
        self._current["loop"] = self._pending_loop
        self._current["loop.prepare"] = self._pending_prepare
        self._pending_loop = self._pending_prepare = 0.0
        self._step_start = now

    def end_step(self) -> None:
        if self._current is None:
            return
        now = time.perf_counter()
        self._current["step"] += now - self._step_start
        for name, seconds in self._current.items():
            self.totals[self._kind][name] += seconds
        self.steps[self._kind] += 1
        self._current = None
        self.dump()
        self._last_step_end = time.perf_counter()  # the dump is not SGLang's loop time

    def note_non_decode_step(self) -> None:
        """A prefill or idle step: the next decode step's loop gap is not a decode loop."""
        self._last_step_end = None
        self._pending_loop = self._pending_prepare = 0.0

    @contextmanager
    def segment(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        if self._current is not None:
            self._current[name] += seconds
        elif name == "prepare":  # runs in the scheduler loop, before the step it prepares
            self._pending_prepare += seconds

    def wrap(self, fn, name: str):
        """`fn` timed as segment `name` (for bound methods of SGLang's components)."""

        @wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)

        return timed

    # ---- output ----
    def snapshot(self) -> dict:
        return {"steps": dict(self.steps),
                "seconds": {kind: dict(values) for kind, values in self.totals.items()}}

    def dump(self) -> None:
        atomic_write_text(self.path, json.dumps(self.snapshot()))


def step_profile_path(environ=None) -> Path | None:
    """`HSPEC_STEP_PROFILE`'s file (unset or blank: None), checked at startup by writing the empty profile (no
    steps yet) to it: a path that cannot be written stops the launch naming the variable and the real cause,
    instead of failing on every decode step."""
    raw = (os.environ if environ is None else environ).get(ENV, "")
    if not raw.strip():
        return None
    path = Path(raw).expanduser()
    fix = "set it to a writable .json file path, or unset it"
    if path.is_dir():
        raise ValueError(f"{ENV}={raw!r} is a directory; {fix} (e.g. {path / 'steps.json'})")
    above = path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():  # mkdir would only say "File exists"
        raise ValueError(f"{ENV}={raw!r}: the step profile cannot be written: {above} is a file, not a directory; {fix}")
    try:
        StepTimer(path).dump()
    except OSError as e:  # core/atomic.py names the file and the cause: a file in the way, permissions, a full disk
        raise ValueError(f"{ENV}={raw!r}: the step profile cannot be written ({e}); {fix}") from None
    return path


def snapshot_delta(after: dict, before: dict | None) -> dict:
    """What happened between two snapshots of the same server (counters are cumulative)."""
    before = before or {"steps": {}, "seconds": {}}
    steps = {k: after["steps"].get(k, 0) - before["steps"].get(k, 0) for k in after["steps"]}
    seconds = {}
    for kind, values in after["seconds"].items():
        old = before["seconds"].get(kind, {})
        seconds[kind] = {name: v - old.get(name, 0.0) for name, v in values.items()}
    return {"steps": steps, "seconds": seconds}


__all__ = ["ENV", "STEP_KINDS", "StepTimer", "snapshot_delta", "step_profile_path"]
