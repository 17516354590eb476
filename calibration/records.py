"""Confidence records: raw confidence logits [n, block_size] and accepted-prefix masks [n, block_size].

One schema for our engine's records and SGLang's DSpark STS recorder shards: a torch `.pt` dict with
`logits` (float [n, block_size]) and `prefix_mask` ([n, block_size], prefix_mask[j] = j < num_accepted; bool
here, float32 in SGLang), plus optional `observed_mask` (newer SGLang: slot j was inside the verify window)
and an optional `meta` dict. The block size is what SGLang calls `gamma`; a shard that also stores it as an
integer "gamma" (older name) or "block_size" entry is read as before, the value checked against the logits."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class ConfidenceRecords:
    logits: np.ndarray  # [n, block_size] float32, raw (pre-sigmoid, pre-STS) confidence logits
    prefix_mask: np.ndarray  # [n, block_size] bool, slot j accepted (all earlier slots accepted too)
    # [n, block_size] bool, slot j was verified; None = every slot verified (static / full-block verify)
    observed_mask: np.ndarray | None = None
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        logits = np.asarray(self.logits, dtype=np.float32)
        prefix = _as_bool_mask(self.prefix_mask, name="prefix_mask")
        if logits.ndim != 2 or logits.shape[1] < 1:
            raise ValueError(
                f"confidence logits must be [n, block_size] with block_size >= 1, got shape {logits.shape}"
            )
        if prefix.shape != logits.shape:
            raise ValueError(f"prefix_mask shape {prefix.shape} != logits shape {logits.shape}")
        if not np.isfinite(logits).all():
            bad = int((~np.isfinite(logits)).any(axis=1).sum())
            raise ValueError(
                f"{bad} record rows hold NaN or infinite confidence logits; the drafter's confidence head "
                "diverged or the recorder was fed garbage: drop those rows or re-record"
            )
        if (prefix[:, 1:] & ~prefix[:, :-1]).any():
            raise ValueError(
                "prefix_mask is not an accepted prefix (a slot is accepted after a rejected one)"
            )
        observed = None
        if self.observed_mask is not None:
            observed = _as_bool_mask(self.observed_mask, name="observed_mask")
            if observed.shape != logits.shape:
                raise ValueError(f"observed_mask shape {observed.shape} != logits shape {logits.shape}")
            if (prefix & ~observed).any():
                raise ValueError(
                    "prefix_mask marks a slot accepted that observed_mask says was never verified"
                )
        object.__setattr__(self, "logits", logits)
        object.__setattr__(self, "prefix_mask", prefix)
        object.__setattr__(self, "observed_mask", observed)
        object.__setattr__(self, "sources", tuple(self.sources))

    @property
    def num_samples(self) -> int:
        return self.logits.shape[0]

    @property
    def block_size(self) -> int:
        return self.logits.shape[1]

    def split(self, *, holdout_fraction: float, seed: int = 0) -> tuple[ConfidenceRecords, ConfidenceRecords]:
        """Random (fit, held-out) split of rows; fit on one, report on the other."""
        if not 0 < holdout_fraction < 1:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
        order = np.random.default_rng(seed).permutation(self.num_samples)
        cut = self.num_samples - int(round(self.num_samples * holdout_fraction))
        if cut <= 0 or cut >= self.num_samples:
            raise ValueError(f"{self.num_samples} records are too few to hold out {holdout_fraction:.0%}")
        return self.take(order[:cut]), self.take(order[cut:])

    def take(self, rows: np.ndarray) -> ConfidenceRecords:
        observed = None if self.observed_mask is None else self.observed_mask[rows]
        return ConfidenceRecords(self.logits[rows], self.prefix_mask[rows], observed, self.sources)


def _as_bool_mask(mask: np.ndarray | torch.Tensor, *, name: str) -> np.ndarray:
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return mask
    if not np.isin(mask, (0, 1)).all():
        raise ValueError(f"{name} must hold only 0/1 (or bool) values")
    return mask.astype(np.bool_)


def num_accepted_to_prefix_mask(num_accepted: np.ndarray, block_size: int) -> np.ndarray:
    return np.arange(block_size)[None, :] < np.asarray(num_accepted).reshape(-1, 1)


# -- reading shards ---------------------------------------------------------------------------------


def resolve_record_paths(data: str | os.PathLike | list[str | os.PathLike] | tuple) -> list[Path]:
    """Expand globs / directories (-> their *.pt) / plain files, deduplicated, in sorted order per pattern."""
    patterns = [data] if isinstance(data, str | os.PathLike) else list(data)
    if not patterns:
        raise ValueError(
            "no record paths given; pass --data DIR/*.pt (shards from ConfidenceRecorder or SGLang)"
        )
    paths: list[Path] = []
    for pattern in patterns:
        pattern = str(pattern)
        if os.path.isdir(pattern):
            matches = sorted(glob.glob(os.path.join(pattern, "*.pt")))
        else:
            matches = sorted(glob.glob(pattern, recursive=True))  # "**" recurses, as users expect
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(
                f"no confidence record shards matched {pattern!r}; pass a glob such as 'records/*.pt' "
                "(shards written by ConfidenceRecorder, `hspec eval --record-confidence DIR` or SGLang's "
                "SGLANG_DSPARK_STS_COLLECT_PATH)"
            )
        paths.extend(Path(m) for m in matches)
    return list(dict.fromkeys(paths))


def load_shard(path: str | os.PathLike) -> ConfidenceRecords:
    path = Path(path)
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated / foreign files
        raise ValueError(
            f"{path}: not a readable confidence record shard ({type(exc).__name__}: {str(exc)[:200]}); "
            "re-record it or leave it out of --data"
        ) from None
    if not isinstance(shard, dict) or "logits" not in shard or "prefix_mask" not in shard:
        keys = sorted(shard) if isinstance(shard, dict) else type(shard).__name__
        raise ValueError(f"{path}: expected a dict with 'logits' and 'prefix_mask' tensors, got {keys}")
    for key in ("logits", "prefix_mask", "observed_mask"):
        if key in shard and not isinstance(shard[key], torch.Tensor):
            raise ValueError(f"{path}: '{key}' must be a tensor, got {type(shard[key]).__name__}")
    observed = shard.get("observed_mask")
    width = shard["logits"].shape[-1] if shard["logits"].ndim == 2 else None
    for key in ("gamma", "block_size"):
        stored = shard.get(key)
        if stored is None or width is None:
            continue
        if isinstance(stored, torch.Tensor) and stored.numel() == 1:
            stored = stored.item()
        if isinstance(stored, bool) or not isinstance(stored, int) or stored != width:
            raise ValueError(
                f"{path}: the shard stores {key}={stored!r} but its logits have {width} slots; "
                "re-record it or leave it out of --data"
            )
    try:
        return ConfidenceRecords(
            logits=shard["logits"].detach().float().numpy(),
            prefix_mask=shard["prefix_mask"],
            observed_mask=observed,
            sources=(str(path),),
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def load_records(
    *,
    data: str | os.PathLike | list[str | os.PathLike] | tuple,
    block_size: int | None = None,
    progress: bool = False,
) -> ConfidenceRecords:
    """Read and concatenate every shard matched by `data`; checks one block size across shards (and
    `block_size`)."""
    paths = resolve_record_paths(data)
    shards = [load_shard(p) for p in tqdm(paths, desc="reading records", unit="shard", disable=not progress)]
    sizes = {s.block_size for s in shards}
    if len(sizes) > 1:
        by_size = {size: [str(s.sources[0]) for s in shards if s.block_size == size][:3] for size in sorted(sizes)}
        raise ValueError(
            f"shards disagree on the block size: {by_size}; select records from one drafter only"
        )
    found = sizes.pop()
    if block_size is not None and found != block_size:
        raise ValueError(
            f"records have block_size={found} slots but --block-size {block_size} was requested; "
            "pass the drafter's block size or point --data at that drafter's records"
        )
    total = sum(s.num_samples for s in shards)
    if total == 0:
        raise ValueError(
            f"the {len(paths)} matched shard(s) hold no records; run the engine longer and re-record"
        )
    any_observed = any(s.observed_mask is not None for s in shards)
    observed = None
    if any_observed:
        observed = np.concatenate(
            [s.observed_mask if s.observed_mask is not None else np.ones_like(s.prefix_mask) for s in shards]
        )
    return ConfidenceRecords(
        logits=np.concatenate([s.logits for s in shards]),
        prefix_mask=np.concatenate([s.prefix_mask for s in shards]),
        observed_mask=observed,
        sources=tuple(str(p) for p in paths),
    )


# -- writing shards ---------------------------------------------------------------------------------


class ConfidenceRecorder:
    """Buffers (raw confidence logits, number of accepted drafts) per verify step and writes shards
    `<path_stem>.<k>.pt` every `flush_every` `add` calls, on `flush()` and on `close()`.

    Same shard layout as SGLang's `StsDataRecorder` (prefix_mask[j] = j < num_accepted). Refuses to
    start over existing shards of the same stem so earlier recordings are never overwritten."""

    def __init__(
        self,
        path_stem: str | os.PathLike,
        *,
        block_size: int,
        flush_every: int = 64,
        meta: dict | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.path_stem = str(path_stem)
        existing = sorted(glob.glob(glob.escape(self.path_stem) + ".*.pt"))
        if existing:
            raise FileExistsError(
                f"confidence shards already exist for stem {self.path_stem!r} (e.g. {existing[0]}); "
                "pick a new stem or move the old shards away"
            )
        self.block_size = int(block_size)
        self.flush_every = int(flush_every)
        self.meta = dict(meta) if meta else None
        self.shard_paths: list[Path] = []
        self._logits: list[torch.Tensor] = []
        self._prefix: list[torch.Tensor] = []
        self._observed: list[torch.Tensor] = []
        self._pending_adds = 0
        self._closed = False

    def add(
        self,
        logits: torch.Tensor,
        num_accepted: torch.Tensor,
        *,
        verify_lengths: torch.Tensor | None = None,
    ) -> None:
        """logits [n, block_size] raw confidence; num_accepted [n] accepted drafts (bonus token excluded);
        verify_lengths [n] draft tokens verified after the anchor (slot j observed iff j < verify_length),
        None = all."""
        if self._closed:
            raise RuntimeError("ConfidenceRecorder.add after close()")
        logits = torch.as_tensor(logits).detach().to("cpu", torch.float32)
        if logits.ndim != 2 or logits.shape[1] != self.block_size:
            raise ValueError(f"logits must be [n, block_size={self.block_size}], got {tuple(logits.shape)}")
        if not torch.isfinite(logits).all():
            raise ValueError("confidence logits hold NaN or inf; not recording this step")
        counts = torch.as_tensor(num_accepted).detach().to("cpu", torch.int64).reshape(-1)
        if counts.shape[0] != logits.shape[0]:
            raise ValueError(f"num_accepted has {counts.shape[0]} rows, logits {logits.shape[0]}")
        if counts.numel() and (counts.min() < 0 or counts.max() > self.block_size):
            raise ValueError(f"num_accepted must be in [0, {self.block_size}], got {counts.tolist()}")
        positions = torch.arange(self.block_size).view(1, -1)
        if verify_lengths is None:
            observed = torch.ones_like(logits, dtype=torch.bool)
        else:
            caps = torch.as_tensor(verify_lengths).detach().to("cpu", torch.int64).reshape(-1, 1)
            if caps.shape[0] != logits.shape[0] or (caps < 0).any() or (counts.view(-1, 1) > caps).any():
                raise ValueError(
                    "verify_lengths must be [n] with 0 <= num_accepted <= verify_length"
                )
            observed = positions < caps
        self._logits.append(logits.clone())
        self._prefix.append(positions < counts.view(-1, 1))
        self._observed.append(observed)
        self._pending_adds += 1
        if self._pending_adds >= self.flush_every:
            self.flush()

    def flush(self) -> Path | None:
        if not self._logits:
            return None
        shard: dict = {"logits": torch.cat(self._logits), "prefix_mask": torch.cat(self._prefix)}
        observed = torch.cat(self._observed)
        if not observed.all():
            shard["observed_mask"] = observed
        if self.meta:
            shard["meta"] = self.meta
        path = Path(f"{self.path_stem}.{len(self.shard_paths)}.pt")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            torch.save(shard, tmp)
            os.replace(tmp, path)
        except BaseException:  # a full disk or a kill mid-save: no partial temp shard left behind
            tmp.unlink(missing_ok=True)
            raise
        self.shard_paths.append(path)
        self._logits.clear()
        self._prefix.clear()
        self._observed.clear()
        self._pending_adds = 0
        return path

    def close(self) -> None:
        if not self._closed:
            self.flush()
            self._closed = True

    def __enter__(self) -> ConfidenceRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_records(records: ConfidenceRecords, path_stem: str | os.PathLike, *, num_shards: int = 1, meta=None):
    """Write records as `num_shards` recorder shards (demo data, splitting a recording)."""
    recorder = ConfidenceRecorder(path_stem, block_size=records.block_size, flush_every=1, meta=meta)
    num_accepted = records.prefix_mask.sum(axis=1)
    verify_lengths = None
    for rows in np.array_split(np.arange(records.num_samples), num_shards):
        if records.observed_mask is not None:
            verify_lengths = torch.from_numpy(records.observed_mask[rows].sum(axis=1))
        recorder.add(
            torch.from_numpy(records.logits[rows]),
            torch.from_numpy(num_accepted[rows]),
            verify_lengths=verify_lengths,
        )
    recorder.close()
    return recorder.shard_paths
