"""Drafter factory and checkpoint I/O: HF-style `config.json` + `model.safetensors`.

The target's embedding and LM head are never saved; `d2t` (draft -> target ids) is. Loading validates
the checkpoint against the target it will run on and names every mismatched field with both values."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors
from torch import nn

from sglang_hspec.core.atomic import atomic_open
from sglang_hspec.model.config import SLOT_CONVENTION, HSpecConfig
from sglang_hspec.model.dflash import DFlashDraftModel
from sglang_hspec.model.hspec import DraftModel
from sglang_hspec.target.geometry import TargetGeometry

ARCHITECTURES = {"hspec": "HSpecDraftModel", "hspec_kv_only": "HSpecDraftModel",
                 "hspec_last_token_only": "HSpecDraftModel", "dflash": "DFlashDraftModel",
                 "dspark": "DSparkDraftModel", "dflash_target_kv": "DFlashDraftModel"}
# geometry fields a drafter depends on (attention heads, RoPE, layer count for ids, vocabulary)
CHECKED_GEOMETRY = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "vocab_size", "rope_theta", "rope_scaling", "qk_norm")


def build_drafter(kind: str, config: HSpecConfig, target_embed: nn.Embedding, target_lm_head: nn.Linear) -> DraftModel:
    """kind in hspec, hspec_kv_only, hspec_last_token_only, dflash, dspark, dflash_target_kv; `config`
    describes the target, ids and heads (see HSpecConfig.for_kind for what each kind changes)."""
    cfg = config.for_kind(kind)
    model = DFlashDraftModel(cfg, target_embed, target_lm_head) if kind in ("dflash", "dspark") else \
        DraftModel(cfg, target_embed, target_lm_head)
    for p in (target_embed.weight, target_lm_head.weight):
        p.requires_grad_(False)
    return model


def build_draft_vocab(token_counts: torch.Tensor, size: int, always_include: tuple[int, ...] = ()) -> torch.Tensor:
    """d2t: the `size` most frequent target ids (ties -> lower id), plus `always_include`, sorted by
    target id so greedy tie-breaking follows the target's order."""
    counts = torch.as_tensor(token_counts, dtype=torch.float64).clone()
    if size > counts.numel():
        raise ValueError(f"draft vocabulary size {size} exceeds the {counts.numel()} counted target ids")
    if len(set(always_include)) > size:
        raise ValueError(f"always_include has {len(set(always_include))} ids, more than the size {size}")
    counts[list(always_include)] = float("inf")
    # stable sort on -count keeps lower ids first among equal counts
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:size]).values


def sglang_capture_ids(cfg: HSpecConfig) -> list[int]:
    """The target layers SGLang captures for this drafter: its hidden-state ids, each once, in layer order
    (SGLang's target packs the captures [tokens, K*H] in layer order and captures a repeated id once)."""
    return sorted(set(cfg.target_layer_ids))


def config_json(model: DraftModel, dtype: torch.dtype | None = None) -> dict:
    """The drafter's config.json. `dtype`: the dtype its weights are stored in (default: the model's), written
    as `torch_dtype`, which SGLang's dtype resolution reads (`_get_and_verify_dtype`; without it SGLang assumes
    float32, which `--dtype auto` turns into float16). SGLang serves the drafter in the target's dtype either
    way (sglang_plugin/worker.py `draft_worker_class`)."""
    cfg = model.config
    t = cfg.target
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point() and p.device.type != "meta"),
                     torch.float32)
    rope = {"rope_theta": t.rope_theta, **{"rope_type": "default", **t.rope_scaling}}
    # The top level must read as a config of the target's family: SGLang loads the drafter's config.json
    # through transformers' AutoConfig (an unknown model_type such as "hspec" fails there), with DSpark's
    # fields (docs/architecture.md, "Checkpoint format"). The `hspec` section is authoritative for our own loaders.
    return {
        "architectures": [ARCHITECTURES[cfg.kind]],
        "model_type": t.model_type,
        "hidden_size": t.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "vocab_size": t.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": t.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": cfg.block_size,
        "num_target_layers": t.num_hidden_layers,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": cfg.confidence_head,
        "confidence_head_with_markov": cfg.markov_rank > 0,
        # slot j predicts anchor + j + 1: the anchor row predicts the first draft (SLOT_CONVENTION)
        "sample_from_anchor": True,
        "draft_vocab_size": cfg.draft_vocab_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": sglang_capture_ids(cfg),
                          "block_size": cfg.block_size, "num_target_layers": t.num_hidden_layers},
        "hspec": cfg.to_dict(),
    }


def save_drafter(model: DraftModel, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `config.json` and `model.safetensors` (trainable weights + d2t) into directory `path`.

    Both files are written to temp files first and renamed into place only when both are complete, so
    a crash or a full disk leaves the previous checkpoint intact (ArtifactWriteError names the file)."""
    state = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        state[name] = t.contiguous().cpu()
    return write_checkpoint(path, state=state, metadata={"format": "pt", "kind": model.config.kind},
                            config_text=json.dumps(config_json(model, dtype), indent=2) + "\n")


def write_checkpoint(path: str | Path, *, state: dict[str, torch.Tensor], metadata: dict[str, str],
                     config_text: str) -> Path:
    """Write `model.safetensors` (state, metadata) and `config.json` (config_text) into directory `path`,
    atomically, the weights renamed last: a reader never pairs new weights with an old config."""
    path = Path(path)
    weights = save_safetensors(state, metadata=metadata)
    with atomic_open(path / "model.safetensors", "wb") as fw, atomic_open(path / "config.json", "w") as fc:
        fw.write(weights)
        fc.write(config_text)
    return path


def check_against_target(cfg: HSpecConfig, target: TargetGeometry, block_size: int | None = None) -> None:
    problems = [(f"target.{f}", a, b) for f, a, b in cfg.target.mismatches(target) if f in CHECKED_GEOMETRY]
    if cfg.mask_token_id >= target.vocab_size:
        problems.append(("mask_token_id", cfg.mask_token_id, f"< {target.vocab_size}"))
    for i in sorted(set(cfg.target_layer_ids) | set(cfg.kv_reuse_layer_ids)):  # each out-of-range id once
        if i >= target.num_hidden_layers:
            problems.append(("target_layer_ids", i, f"< {target.num_hidden_layers}"))
    if problems:
        raise ValueError(f"drafter checkpoint does not match the target: {_problem_lines(problems)}. "
                         "Load the drafter trained for this target (or retrain it).")
    if block_size is not None and block_size != cfg.block_size:
        # a block-parallel drafter proposes exactly the block it was trained on (the policy may verify less)
        raise ValueError(f"block_size {block_size} was requested, but this {cfg.kind} drafter proposes "
                         f"{cfg.block_size} tokens per step (its trained block_size): leave block_size unset "
                         f"(drop --block-size) or ask for {cfg.block_size}")


def _problem_lines(problems: list[tuple[str, object, object]]) -> str:
    return "; ".join(f"{f}: checkpoint {a!r} vs target {b!r}" for f, a, b in problems)


def read_checkpoint_config(path: str | Path, target: TargetGeometry | None = None) -> HSpecConfig:
    """The drafter config in `path`/config.json (its `hspec` section). Every problem names the file; with
    `target`, a checkpoint built for another target reports the mismatched geometry fields first (a layer
    count of 24 vs 30 is the cause, a layer id out of range only its symptom)."""
    file = Path(path) / "config.json"
    fix = "re-copy the checkpoint, or write it again with sglang_hspec.model.checkpoint.save_drafter"
    try:
        raw = json.loads(file.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not a text file (not UTF-8): it is damaged; {fix}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}): it is truncated or damaged; {fix}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("hspec"), dict):
        raise ValueError(f"{file} has no 'hspec' section; was it written by save_drafter? ({fix})")
    section = raw["hspec"]
    convention = section.get("slot_convention")
    if convention != SLOT_CONVENTION:
        raise ValueError(f"{file}: slot_convention: checkpoint {convention!r} vs runtime {SLOT_CONVENTION!r}; "
                         "this runtime drives DSpark's anchor-then-masks convention")
    try:
        stored = TargetGeometry.from_dict(section.get("target"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: its hspec.target section is not a valid target geometry ({e}); {fix}") from None
    # read as lists below, before HSpecConfig checks them: an integer there raised a TypeError
    for name, example in (("target_layer_ids", "[1, 8, 15, 22, 28]"), ("kv_reuse_layer_ids", "[15, 22, 28]")):
        ids = section.get(name)
        if name in section and not (ids is None and name == "kv_reuse_layer_ids") and not _layer_id_list(ids):
            raise ValueError(f"{file}: invalid drafter config: {name} must be a list of target layer ids "
                             f"(integers, e.g. {example}), got {ids!r}; {fix}")
    if target is not None:
        problems = [(f"target.{f}", a, b) for f, a, b in stored.mismatches(target) if f in CHECKED_GEOMETRY]
        ids = [*(section.get("target_layer_ids") or ()), *(section.get("kv_reuse_layer_ids") or ())]
        for i in sorted({i for i in ids if isinstance(i, int) and i >= target.num_hidden_layers}):
            problems.append(("target_layer_ids", i, f"< {target.num_hidden_layers}"))
        if problems:
            raise ValueError(f"drafter checkpoint {path} does not match the target: {_problem_lines(problems)}. "
                             "Load the drafter trained for this target (or retrain it).")
    try:
        return HSpecConfig.from_dict(section)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{file}: invalid drafter config: {e}") from None


def _layer_id_list(value: object) -> bool:
    """A JSON list of integers (not bools)."""
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _unreadable(file: Path, error: Exception) -> ValueError:
    if not file.is_file():
        return ValueError(f"{file} does not exist: a drafter checkpoint is a directory with config.json and "
                          "model.safetensors (sglang_hspec.model.checkpoint.save_drafter writes both)")
    return ValueError(f"{file} cannot be read as safetensors ({error}): it is truncated or damaged; re-copy the "
                      "checkpoint, or write it again with sglang_hspec.model.checkpoint.save_drafter")


def read_checkpoint_weights(path: str | Path) -> dict[str, torch.Tensor]:
    file = Path(path) / "model.safetensors"
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e) from None


def check_checkpoint_weights_readable(path: str | Path) -> None:
    """Raise the error `read_checkpoint_weights` would, from the safetensors header alone (milliseconds): its
    length and that its tensors cover the file, so a truncated or damaged checkpoint is named before a server
    spends a minute starting."""
    file = Path(path) / "model.safetensors"
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e) from None


def load_state_strict(model: nn.Module, state: dict[str, torch.Tensor], *, what: str) -> None:
    """Load weights that must match the model exactly (names and shapes), cast to the model's dtypes."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ValueError(f"{what}: weight {name} has shape {tuple(t.shape)}, the model {tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})


def load_drafter(path: str | Path, target_geometry: TargetGeometry, embed: nn.Embedding, lm_head: nn.Linear,
                 *, block_size: int | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> DraftModel:
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path} is not a drafter checkpoint: it needs config.json and model.safetensors")
    cfg = read_checkpoint_config(path, target_geometry)
    check_against_target(cfg, target_geometry, block_size)
    state = read_checkpoint_weights(path)
    model = build_drafter(cfg.kind, cfg, embed, lm_head)
    stored = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    model.to(dtype=dtype or stored)  # never round the stored weights through a narrower dtype
    load_state_strict(model, state, what=f"{path}/model.safetensors ({cfg.kind} drafter)")
    if int(model.d2t.max()) >= target_geometry.vocab_size:
        raise ValueError(f"d2t: checkpoint maps to id {int(model.d2t.max())} vs target vocab_size "
                         f"{target_geometry.vocab_size}")
    model._lm_cache = None
    if device is not None:
        model.to(device=device)
    return model.eval()
