"""Server-argument handling for `--speculative-algorithm HSPEC` (no SGLang import: unit-testable anywhere).

SGLang calls `validate_server_args` and `handle_server_args` with a recorder that reads through its
resolving view and declares plain attribute writes (`sglang/srt/arg_groups/overrides.py`
`record_foreign_defaults`), so both read and write `server_args.x` directly. The drafter checkpoint's
`config.json` (`hspec` section, see sglang_hspec/model/checkpoint.py) is the single source of truth for
the block size: the verify window is block size + 1 draft tokens (the anchor plus the block).

`launch_checks` runs all of it (and the SGLang version check) as a resolution hook around SGLang's
`handle_speculative_decoding` step, before SGLang opens the drafter's config.json itself: a missing
drafter path, a drafter for another target or a wrong SGLang release then stops the launcher within
seconds with our message, not with a transformers hub error or "Unknown speculative algorithm".
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from sglang_hspec.model.checkpoint import (
    check_against_target,
    check_checkpoint_weights_readable,
    read_checkpoint_config,
)
from sglang_hspec.model.config import SLOT_CONVENTION, HSpecConfig
from sglang_hspec.model.tensor_parallel import check_shardable
from sglang_hspec.target.geometry import TargetGeometry

from .sglang_names import given_num_draft_tokens, set_server_block_size, sglang_num_draft_tokens

logger = logging.getLogger(__name__)

ALGORITHM = "HSPEC"
DEFAULT_MAX_RUNNING_REQUESTS = 48  # as DSpark's resolver (speculative_hook._handle_dspark)
# KV pools the drafter's attention reads in place (sglang_hspec/kernels): the model dtype, or per-tensor
# FP8 with the target layers' k/v scales; block-scaled MXFP8 / FP4 pools are not readable yet
READABLE_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")

# config fields that mark MLA / DeepSeek sparse attention targets (their KV is a latent, not per-head K/V)
_MLA_FIELDS = ("kv_lora_rank", "index_topk")
# hybrid sliding-window markers besides `layer_types` (Gemma-2/3, Cohere-2, GPT-OSS style configs)
_HYBRID_SWA_FIELDS = ("sliding_window_pattern", "interleaved_sliding_window")


def _looks_local(path: str) -> bool:
    # hub ids are "name" or "namespace/name"; anything else with a path shape is meant as a local path
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or "\\" in path


def _config_json(path: str | Path, what: str) -> dict[str, Any]:
    """config.json of a local checkpoint dir, or of a hub id already in the local HF cache."""
    p = Path(path).expanduser()
    if p.is_dir():
        f = p / "config.json"
        if not f.is_file():
            raise ValueError(f"{what} {path!s} has no config.json; pass a checkpoint directory")
        return json.loads(f.read_text())
    if p.exists():
        raise ValueError(f"{what} {path!s} is a file; pass the checkpoint directory that holds config.json")
    if _looks_local(str(path)):
        raise ValueError(f"{what} {path!s} does not exist (neither a local checkpoint directory nor a cached "
                         "hub model); pass an existing checkpoint directory (config.json and model.safetensors)")
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(str(path), "config.json")).read_text())
    except Exception as e:  # offline and not cached, bad id, ...
        raise ValueError(
            f"{what} {path!s} is neither a local checkpoint directory nor a cached hub model ({e}); "
            "pass the directory that holds its config.json"
        ) from e


def read_drafter_config(draft_path: str | Path, target: TargetGeometry | None = None) -> HSpecConfig:
    """The drafter's config from its config.json; with `target`, a drafter built for another target names the
    mismatched geometry fields (e.g. num_hidden_layers 24 vs 30) rather than a symptom of them."""
    check_drafter_json(draft_path)
    return read_checkpoint_config(draft_path, target)


def check_drafter_json(draft_path: str | Path) -> None:
    """What SGLang itself needs of an H-Spec drafter's config.json (before our config is read)."""
    raw = _config_json(draft_path, "--speculative-draft-model-path")
    if "hspec" not in raw:
        raise ValueError(
            f"--speculative-draft-model-path {draft_path!s} is not an H-Spec drafter: its config.json has no "
            "'hspec' section (write drafters with sglang_hspec.model.checkpoint.save_drafter). For a stock "
            "DSpark draft use --speculative-algorithm DSPARK."
        )
    if raw.get("model_type") not in (None, "llama", "qwen2", "qwen3"):
        # SGLang parses the drafter's config.json with transformers' AutoConfig before our code runs
        raise ValueError(
            f"{draft_path!s}/config.json has model_type {raw.get('model_type')!r}, which transformers cannot "
            "load; H-Spec drafters carry their target's model_type (llama/qwen2/qwen3). Rewrite it with "
            "sglang_hspec.model.checkpoint.config_json (older save_drafter versions wrote 'hspec')"
        )
    if raw.get("sample_from_anchor", True) is not True:
        # SGLang's DSpark runtime reads this flag: False means a block_size + 1 row block whose anchor row is
        # dropped (DFlash's slot j -> anchor + j), which silently drops acceptance to ~1 for our drafters.
        raise ValueError(
            f"{draft_path!s}/config.json sets sample_from_anchor={raw['sample_from_anchor']!r}, but H-Spec "
            f"drafters use DSpark's slot convention ({SLOT_CONVENTION}: the anchor row predicts the first "
            "draft token), which SGLang runs with sample_from_anchor true; set it to true"
        )


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    # multimodal wrappers keep the language model's fields under text_config
    return {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw


def unsupported_target_reason(raw: dict[str, Any]) -> str | None:
    """Why H-Spec cannot read this target's KV cache in place, or None. The drafter's attention reads
    per-head post-RoPE K/V from one full-attention pool (`MHATokenToKVPool`)."""
    cfg = _text_config(raw)
    if any(cfg.get(f) is not None for f in _MLA_FIELDS) or cfg.get("use_mla"):
        return ("MLA/DSA attention (a compressed latent KV cache, no per-head keys to read); "
                "H-Spec supports MHA/GQA targets such as Llama, Qwen2 and Qwen3")
    types = [str(t) for t in cfg.get("layer_types") or ()]
    if any("sliding" in t for t in types) or any(cfg.get(f) is not None for f in _HYBRID_SWA_FIELDS):
        return ("hybrid sliding-window attention (SGLang keeps such layers in a separate SWA pool that "
                "evicts old tokens); H-Spec needs a target whose layers all use full attention")
    if any(t in ("linear_attention", "mamba", "mamba2") for t in types):
        return "hybrid linear-attention/Mamba layers (no KV cache to read in those layers)"
    return None


def target_geometry(raw: dict[str, Any]) -> TargetGeometry:
    from transformers import AutoConfig

    cfg = _text_config(raw)
    hf = AutoConfig.for_model(**cfg) if "model_type" in cfg else None
    if hf is None:
        raise ValueError("the target's config.json has no model_type")
    return TargetGeometry.from_hf_config(hf)


def check_environment(environ: dict[str, str] | None = None) -> None:
    """Parse every HSPEC_* variable the launcher or the scheduler process reads. A bad value stops the launch
    here, naming the variable and the fix, instead of after the model loads in the worker (which alone reads
    HSPEC_SPECULATION_GUARD and HSPEC_PLAIN_STEP_FORWARD), or never (one the chosen policy ignores)."""
    from .env import plain_step_forward
    from .lookup_splice import lookup_enabled
    from .speculation_policy import speculation_guard, speculation_policy
    from .sps_cache import auto_profile_enabled, auto_profile_settings, is_profiling_server
    from .step_timer import step_profile_path

    env = os.environ if environ is None else environ
    speculation_policy(env)
    speculation_guard(env)
    plain_step_forward(env)
    lookup_enabled(env)
    auto_profile_enabled(env)
    auto_profile_settings(env)
    is_profiling_server(env)
    step_profile_path(env)  # HSPEC_STEP_PROFILE: writable, or the launch stops with the cause


def validate_server_args(server_args: Any) -> None:
    """Reject what HSPEC cannot serve, in the launcher, before any process starts."""
    check_environment()
    if getattr(server_args, "speculative_draft_model_path", None) is None:
        raise ValueError(
            "--speculative-algorithm HSPEC requires --speculative-draft-model-path <H-Spec drafter checkpoint>"
        )
    if int(getattr(server_args, "pp_size", 1) or 1) != 1:
        raise ValueError(f"HSPEC does not support pipeline parallelism (got --pp-size {server_args.pp_size}); "
                         "use --pp-size 1")
    attn_dp = int(getattr(server_args, "attn_dp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False) or attn_dp > 1:
        # SGLang folds --enable-dp-attention --dp-size N into attn_dp_size N before this check runs
        # (arg_groups/parallel_hook.py `handle_deprecated_dp_attention`)
        raise ValueError(f"HSPEC does not support DP attention (--enable-dp-attention / --attn-dp-size {attn_dp}): "
                         "the drafter reads the target KV pool of its own rank; drop the flag (--dp-size N without "
                         "it runs N independent replicas, which HSPEC serves)")
    if (getattr(server_args, "disaggregation_mode", "null") or "null") != "null":
        raise ValueError("HSPEC does not support prefill/decode disaggregation yet; drop --disaggregation-mode")
    if getattr(server_args, "enable_unified_memory", False):
        raise ValueError("HSPEC does not support --enable-unified-memory")
    from .lookup_splice import check_lookup_server_args, lookup_enabled

    if lookup_enabled():
        check_lookup_server_args(server_args)
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", None) or "auto")
    if kv_dtype not in READABLE_KV_CACHE_DTYPES:
        raise ValueError(f"HSPEC does not support --kv-cache-dtype {kv_dtype}: the drafter reads the target's KV "
                         "pool in place and dequantises per-tensor FP8 only; use one of "
                         f"{', '.join(READABLE_KV_CACHE_DTYPES)}")
    raw = _config_json(server_args.model_path, "--model-path")
    reason = unsupported_target_reason(raw)
    if reason:
        raise ValueError(f"HSPEC cannot serve target {server_args.model_path!s}: {reason}")
    try:
        geometry = target_geometry(raw)
    except ValueError as e:
        raise ValueError(f"HSPEC cannot serve target {server_args.model_path!s}: {e}") from e
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    try:
        # SGLang shards the target's KV heads over the ranks; each rank's drafter reads its shard in place
        check_shardable(geometry.num_key_value_heads, tp)
    except ValueError as e:
        raise ValueError(f"HSPEC cannot serve --tp-size {tp} (also spelled --tp): {e}") from None
    check_drafter_json(server_args.speculative_draft_model_path)
    try:
        drafter = read_checkpoint_config(server_args.speculative_draft_model_path, geometry)
        check_against_target(drafter, geometry)
    except ValueError as e:
        raise ValueError(
            f"the HSPEC drafter {server_args.speculative_draft_model_path!s} was built for another target than "
            f"--model-path {server_args.model_path!s}: {e}"
        ) from None
    last = geometry.num_hidden_layers - 1
    if last in drafter.hidden_layer_ids:
        raise ValueError(
            f"the drafter reads target layer {last}'s output (target_layer_ids {list(drafter.target_layer_ids)}), "
            f"which SGLang never captures (it captures the input of layer id + 1, and the target has "
            f"{geometry.num_hidden_layers} layers); train the drafter with ids below {last}"
        )


def handle_server_args(server_args: Any) -> None:
    """Resolve the speculative arguments as DSpark does (`_handle_dspark`), from the drafter checkpoint."""
    drafter = read_drafter_config(server_args.speculative_draft_model_path)
    # a truncated or damaged model.safetensors is named here, in the launcher, before any process starts
    check_checkpoint_weights_readable(server_args.speculative_draft_model_path)
    verify_rows = sglang_num_draft_tokens(block_size=drafter.block_size)
    explicit = given_num_draft_tokens(server_args)
    if explicit is not None and explicit != verify_rows:
        raise ValueError(
            f"--speculative-num-draft-tokens {explicit} does not match the drafter: its block size is "
            f"{drafter.block_size}, so each request verifies {verify_rows} tokens (the anchor and the "
            f"block); drop the flag or pass {verify_rows}"
        )
    block = getattr(server_args, "speculative_dspark_block_size", None)
    if block is not None and int(block) != drafter.block_size:
        raise ValueError(
            f"--speculative-dspark-block-size {block} does not match the drafter's block size "
            f"{drafter.block_size}; drop the flag"
        )
    for name in ("speculative_num_steps", "speculative_eagle_topk"):
        value = getattr(server_args, name, None)
        if value is not None and int(value) != 1:
            logger.warning("HSPEC drafts one block per step; overriding %s=%s to 1", name, value)
        setattr(server_args, name, 1)
    set_server_block_size(server_args, block_size=drafter.block_size)
    if getattr(server_args, "max_running_requests", None) is None:
        server_args.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS
    if getattr(server_args, "enable_mixed_chunk", False):
        logger.warning("HSPEC does not support mixed chunked prefill (v1); disabling --enable-mixed-chunk")
    server_args.enable_mixed_chunk = False
    from .sps_cache import resolve_sps_table

    resolve_sps_table(server_args, block_size=drafter.block_size)  # given table, cached auto-profile, or a WARNING


# SGLang's resolution step that resolves --speculative-algorithm (an overridable step in 0.5.23's
# sglang/srt/arg_groups/resolution_hooks.py); the first thing in it opens the drafter's config.json.
RESOLUTION_STEP = "handle_speculative_decoding"
_launch_checks_registered = False


def launch_checks(server_args: Any, previous) -> None:
    """Resolution hook around SGLang's `handle_speculative_decoding`: for HSPEC, check the SGLang version
    and every HSPEC server argument (`validate_server_args`) before SGLang's own handling, in the launcher
    (or `sgl.Engine`), before any process starts. SGLang validates again through the registered
    validator; both only read."""
    from sglang.srt.arg_groups.overrides import resolving_view

    view = resolving_view(server_args)
    if str(getattr(view, "speculative_algorithm", None) or "").upper() == ALGORITHM:
        from . import check_sglang_version

        check_sglang_version()  # with another release register() failed: say why here, where HSPEC is asked for
        validate_server_args(view)
    previous(server_args)


def register_launch_checks() -> None:
    """Install `launch_checks` (idempotent). Called by `register()` before its version check, so a wrong
    SGLang release is reported at the HSPEC launch itself. Another release may lack the hook API: then
    SGLang's plugin loader logs register()'s version error and nothing more can be done."""
    global _launch_checks_registered
    if _launch_checks_registered:
        return
    try:
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

        register_resolution_hook(RESOLUTION_STEP)(launch_checks)
    except Exception as e:  # noqa: BLE001 - best effort; register() reports the version problem itself
        logger.debug("HSPEC launch checks not installed: %s", e)
        return
    _launch_checks_registered = True
