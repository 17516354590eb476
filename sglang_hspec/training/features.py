"""Target-feature cache: the frozen target runs once per training example, every later epoch (and every
later run on the same target and data, e.g. the other drafter kinds of scripts/train_comparison.sh)
reads its hidden states, post-RoPE KV and final-norm hidden states back from disk.

Layout of `data.feature_cache` (a directory):
- `manifest.json`: what the shards hold (`CacheManifest`: the target's fingerprint, layer ids, dtype);
  a cache built for another target or dtype, or lacking a layer the drafter reads, is refused with the
  fix. The trainer stores the hidden states of all `model.target_layer_ids` and the KV of the drafter's
  layers plus the last three of them, so every drafter kind of one recipe (hspec, its ablations, dspark,
  dflash; not dflash_target_kv, which reads five KV layers) shares one cache.
- `shards/<key>.safetensors`, one per example, key = sha1 of its token ids (the same sequence hits
  whatever its record id or position in the data): `hidden` [T, n_ids, d], `k.<L>` / `v.<L>`
  [kv_heads, T, head_dim] for each KV layer L, `final_hidden` [T, d], and (training.cached_log_partition)
  `log_partition` [T] float32, the logsumexp of the LM head's logits over the stored `final_hidden`. The
  next-token logits are not stored ([T, V] would be ~10x the rest): the trainer recomputes the target's
  draft-vocabulary probabilities from `final_hidden` with the LM head, and with `log_partition` only the
  head's draft-vocabulary rows run (exp(logit - log_partition): 1/6 of the head for SmolLM2).

Disk cost per token: ((n_ids + 1) * d + 2 * n_kv * kv_heads * head_dim) values plus the 4-byte
log-partition (`bytes_per_token`); the SmolLM2 H-Spec recipe (5 hidden ids, 3 KV layers, d 576, 3 x 64 KV)
stores 4608 values: 18.4 KB per token in fp32, 9.2 KB in bf16, i.e. at most 5.7 GB (fp32) for the 600
sequences x <=512 tokens of its 300 steps. Shards are written atomically (temp file + os.replace): a killed run leaves whole shards only.

Before the first shard, `FeatureCache.plan` prints that cost for the examples not cached yet (bytes per
token x tokens = total, one line) and refuses when the free disk under the cache is smaller.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save

from sglang_hspec.core.atomic import atomic_write_bytes
from sglang_hspec.target.adapter import TargetFeatures

FORMAT = "hspec-target-features/1"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class CacheManifest(msgspec.Struct, frozen=True, kw_only=True):
    format: str
    target_fingerprint: str
    hidden_layer_ids: list[int]
    kv_layer_ids: list[int]
    dtype: str  # fp32 | bf16

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise ValueError(f"feature cache format {self.format!r} is not {FORMAT!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"feature cache dtype {self.dtype!r} must be one of {sorted(_DTYPES)}")


def target_fingerprint(model: torch.nn.Module) -> str:
    """sha1 of the target's config and of its embedding, first and last decoder layer weights: two
    targets that differ anywhere a cache would notice differ here."""
    h = hashlib.sha1(model.config.to_json_string(use_diff=False).encode())
    layers = model.model.layers
    tensors = [model.get_input_embeddings().weight, *layers[0].state_dict().values(), *layers[-1].state_dict().values()]
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def example_key(input_ids: list[int]) -> str:
    return hashlib.sha1(torch.tensor(input_ids, dtype=torch.int64).numpy().tobytes()).hexdigest()[:24]


def bytes_per_token(*, hidden_size: int, num_hidden_ids: int, num_kv_layers: int, num_kv_heads: int,
                    head_dim: int, dtype: str, log_partition: bool = True) -> int:
    values = (num_hidden_ids + 1) * hidden_size + 2 * num_kv_layers * num_kv_heads * head_dim
    return values * torch.tensor([], dtype=_DTYPES[dtype]).element_size() + 4 * log_partition


def target_bytes_per_token(config, *, num_hidden_ids: int, num_kv_layers: int, dtype: str,
                           log_partition: bool = True) -> int:
    """`bytes_per_token` of a Hugging Face target config (hidden size, KV heads, head dim)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return bytes_per_token(hidden_size=config.hidden_size, num_hidden_ids=num_hidden_ids, num_kv_layers=num_kv_layers,
                           num_kv_heads=config.num_key_value_heads, head_dim=head_dim, dtype=dtype,
                           log_partition=log_partition)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # stdout carries the trainer's JSON result


class FeatureCache:
    """Per-example target features under `root` (see the module docstring)."""

    def __init__(self, root: str | Path, *, target_fingerprint: str, hidden_layer_ids, kv_layer_ids,
                 dtype: str = "fp32"):
        self.root = Path(root)
        self.shards = self.root / "shards"
        self.manifest = CacheManifest(format=FORMAT, target_fingerprint=target_fingerprint,
                                      hidden_layer_ids=[int(i) for i in hidden_layer_ids],
                                      kv_layer_ids=[int(i) for i in kv_layer_ids], dtype=dtype)
        self.dtype = _DTYPES[dtype]
        self.hits = self.misses = self.bytes_written = 0
        path = self.root / "manifest.json"
        if path.is_file():
            try:
                have = msgspec.json.decode(path.read_bytes(), type=CacheManifest)
            except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
                raise ValueError(f"data.feature_cache {path} is not a feature-cache manifest ({e}); "
                                 "point data.feature_cache at an empty or a feature-cache directory") from None
            diff = [f for f in ("format", "target_fingerprint", "dtype") if getattr(have, f) != getattr(self.manifest, f)]
            if diff:
                raise ValueError(
                    f"data.feature_cache {self.root} was built for another setup (differs in {diff}: "
                    f"{[getattr(have, f) for f in diff]} vs now {[getattr(self.manifest, f) for f in diff]}); "
                    "use another directory for this target / dtype, or delete that one")
            self.manifest = have  # it may hold more layers than asked for: reads select the ones needed
        else:
            self.shards.mkdir(parents=True, exist_ok=True)
            self._guard_disk(lambda: atomic_write_bytes(path, msgspec.json.format(msgspec.json.encode(self.manifest))))
        self.shards.mkdir(parents=True, exist_ok=True)

    def check_covers(self, *, hidden_layer_ids, kv_layer_ids) -> None:
        """Raise unless the shards hold every layer a drafter reads."""
        lacking = [f"hidden {i}" for i in hidden_layer_ids if i not in self.manifest.hidden_layer_ids]
        lacking += [f"kv {i}" for i in kv_layer_ids if i not in self.manifest.kv_layer_ids]
        if lacking:
            raise ValueError(
                f"data.feature_cache {self.root} holds hidden layers {self.manifest.hidden_layer_ids} and KV layers "
                f"{self.manifest.kv_layer_ids}, not {lacking} that this drafter reads; use another directory")

    def _path(self, key: str) -> Path:
        return self.shards / f"{key}.safetensors"

    def _guard_disk(self, write) -> None:
        try:
            write()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            free = shutil.disk_usage(self.root).free
            raise OSError(errno.ENOSPC, f"no space left on device writing the target-feature cache {self.root} "
                          f"({free / 2**30:.1f} GiB free); free space, set data.feature_cache_dtype=bf16 (half "
                          "the size) or data.feature_cache to a larger disk, or unset it to run the target "
                          "every step") from None

    def plan(self, examples: Sequence[dict], *, target_config, log_partition: bool = True,
             report: Callable[[str], None] = _stderr_line) -> int:
        """Report what caching `examples` will write, before any of it is: bytes per token x the tokens of the
        examples not cached yet = total (an upper bound: a run that stops early caches only the examples it
        drew). Raise OSError(ENOSPC) naming the fixes when the free disk under the cache is smaller. Returns
        the total bytes."""
        per_token = target_bytes_per_token(target_config, num_hidden_ids=len(self.manifest.hidden_layer_ids),
                                           num_kv_layers=len(self.manifest.kv_layer_ids), dtype=self.manifest.dtype,
                                           log_partition=log_partition)
        todo = [e for e in examples if not self.has(example_key(list(e["input_ids"])))]
        tokens = sum(len(e["input_ids"]) for e in todo)
        total = per_token * tokens
        free = shutil.disk_usage(self.root).free
        report(f"target-feature cache {self.root}: {per_token:,} bytes per token x {tokens:,} tokens "
               f"({len(todo):,} of {len(examples):,} examples not cached yet) = {_size(total)}; {_size(free)} free")
        if total > free:
            fixes = "free space, " + ("" if self.manifest.dtype == "bf16" else
                                      "set data.feature_cache_dtype=bf16 (half the size), ")
            raise OSError(errno.ENOSPC, f"data.feature_cache {self.root} would need {_size(total)} ({per_token:,} "
                          f"bytes per token x {tokens:,} tokens) but only {_size(free)} is free there; {fixes}point "
                          "data.feature_cache at a larger disk, or unset it to run the target every step")
        return total

    def has(self, key: str) -> bool:
        return self._path(key).is_file()

    def stored(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the shards store it (the cache's dtype): what a later read returns."""
        return t.detach().to(self.dtype)

    def put(self, key: str, *, hidden: torch.Tensor | None, kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
            final_hidden: torch.Tensor, log_partition: torch.Tensor | None = None) -> None:
        """One example's features: hidden [T, n, d] (or None), kv {L: (K, V) [kv, T, D]}, final_hidden [T, d],
        and optionally the log-partition [T] of the LM head over the stored final_hidden (kept in float32)."""
        tensors = {"final_hidden": final_hidden}
        if hidden is not None:
            tensors["hidden"] = hidden
        for layer_id in self.manifest.kv_layer_ids:
            tensors[f"k.{layer_id}"], tensors[f"v.{layer_id}"] = kv[layer_id]
        tensors = {n: t.detach().to(device="cpu", dtype=self.dtype).contiguous() for n, t in tensors.items()}
        if log_partition is not None:
            if log_partition.shape != final_hidden.shape[:1]:
                raise ValueError(f"log_partition must be [T={final_hidden.shape[0]}], "
                                 f"got {tuple(log_partition.shape)}")
            tensors["log_partition"] = log_partition.detach().to(device="cpu", dtype=torch.float32).contiguous()
        path = self._path(key)

        self._guard_disk(lambda: atomic_write_bytes(path, save(tensors)))
        self.bytes_written += path.stat().st_size

    def load_batch(self, keys: list[str], *, length: int, dtype: torch.dtype, device, hidden_layer_ids=None,
                   kv_layer_ids=None) -> TargetFeatures:
        """Right-padded [B, length, ...] features of the cached examples `keys` (zeros past each end), with
        the hidden states of `hidden_layer_ids` in that order and the KV of `kv_layer_ids` (default: all)."""
        hidden_layer_ids = self.manifest.hidden_layer_ids if hidden_layer_ids is None else list(hidden_layer_ids)
        kv_layer_ids = self.manifest.kv_layer_ids if kv_layer_ids is None else list(kv_layer_ids)
        self.check_covers(hidden_layer_ids=hidden_layer_ids, kv_layer_ids=kv_layer_ids)
        shards = [load_file(str(self._path(k))) for k in keys]
        self.hits += len(keys)
        B = len(keys)

        def stack(name: str, time_dim: int) -> torch.Tensor:
            first = shards[0][name]
            shape = list(first.shape)
            shape[time_dim] = length
            out = torch.zeros(B, *shape, dtype=dtype)
            for b, s in enumerate(shards):
                t = s[name]
                out[b].narrow(time_dim, 0, t.shape[time_dim]).copy_(t)
            return out.to(device)

        hidden = None
        if hidden_layer_ids:
            hidden = stack("hidden", 0)
            if hidden_layer_ids != self.manifest.hidden_layer_ids:
                pick = [self.manifest.hidden_layer_ids.index(i) for i in hidden_layer_ids]
                hidden = hidden[:, :, pick].contiguous()
        kv = {i: (stack(f"k.{i}", 1), stack(f"v.{i}", 1)) for i in kv_layer_ids}
        log_partition = None
        if all("log_partition" in s for s in shards):  # shards written before it existed have none
            log_partition = torch.zeros(B, length, dtype=torch.float32)
            for b, s in enumerate(shards):
                log_partition[b, : s["log_partition"].shape[0]] = s["log_partition"]
            log_partition = log_partition.to(device)
        return TargetFeatures(hidden=hidden, kv=kv, final_hidden=stack("final_hidden", 0),
                              log_partition=log_partition)

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.shards.glob("*.safetensors"))


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
