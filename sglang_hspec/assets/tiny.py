"""Tiny random Llama / Qwen2 / Qwen3 targets and a tiny BPE tokenizer for fast tests (built in code)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

log = logging.getLogger(__name__)

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def tiny_target_config(
    arch: str = "llama",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 4096,
):
    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny target arch {arch!r}; choose one of {sorted(_CONFIGS)}")
    cfg = _CONFIGS[arch](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "qwen2":
        cfg.use_sliding_window = False
    return cfg


def tiny_target(arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs):
    """A randomly initialised causal LM in eval mode. Same (arch, seed, kwargs) -> same weights.

    The init is scaled up (std 0.2 instead of 0.02) so that next-token distributions are peaked
    enough for speculative-decoding tests to see both acceptances and rejections."""
    cfg = tiny_target_config(arch, **kwargs)
    cfg.initializer_range = 0.2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


# ---------------------------------------------------------------- tiny tokenizer and saved tiny targets

TINY_VOCAB_SIZE = 1024
# Same special-token layout as SmolLM2 (ids 0/1/2), so tiny targets use bos 1, eos 2, pad 2 like it.
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TINY_TRAIN_FILES = 60
_TINY_TOKENIZER_VERSION = 1  # bump when the recipe changes; the cache key includes it


def _tiny_training_files() -> list[Path]:
    """60 mid-sized top-level stdlib modules, by name: always present, deterministic, ~1.4 MB."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))
    chosen = [p for p in candidates if 8_000 <= p.stat().st_size <= 60_000][:_TINY_TRAIN_FILES]
    if len(chosen) < _TINY_TRAIN_FILES // 2:
        raise RuntimeError(
            f"found only {len(chosen)} stdlib .py files under {stdlib} to train the tiny tokenizer; "
            f"is the Python standard library source installed (not just .pyc)?"
        )
    return chosen


def _train_tiny_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _wrap_tiny_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def tiny_tokenizer(cache_dir: str | os.PathLike | None = None):
    """Byte-level BPE (vocab 1024) trained on stdlib Python, ChatML specials, as PreTrainedTokenizerFast.

    Training takes a few seconds, so the result is cached under `cache_dir` (default: the project
    cache, $HSPEC_CACHE_DIR) in a directory named by a hash of the training text and recipe: a
    different stdlib gives a different, equally deterministic tokenizer, never a stale one."""
    from transformers import PreTrainedTokenizerFast

    from .embedded import default_cache_dir

    texts = [p.read_text(encoding="utf-8", errors="replace") for p in _tiny_training_files()]
    digest = hashlib.sha256(f"v{_TINY_TOKENIZER_VERSION}:{TINY_VOCAB_SIZE}".encode())
    for text in texts:
        digest.update(text.encode() + b"\0")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-bpe{TINY_VOCAB_SIZE}-{digest.hexdigest()[:16]}"
    if (target / "tokenizer.json").is_file():
        try:
            return PreTrainedTokenizerFast.from_pretrained(target)
        except Exception as e:  # a corrupt cache must not break tests: rebuild it
            log.warning("tiny tokenizer cache %s is unreadable (%s); retraining", target, e)
            shutil.rmtree(target, ignore_errors=True)
    tokenizer = _wrap_tiny_tokenizer(_train_tiny_tokenizer(texts))
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "tokenizer.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(target)


def save_tiny_target(
    path: str | os.PathLike,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer=None,
    num_layers: int = 2,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    **config_overrides,
) -> Path:
    """Write a tiny random target as an HF model dir (config.json, model.safetensors, generation and
    tokenizer files) that AutoModelForCausalLM / AutoTokenizer and SGLang's CPU server load.

    Defaults are the SGLang CPU-tier target (Qwen3, 2 layers, ~0.56 M params, bf16); a matching
    draft is `save_tiny_target(path, num_layers=1, seed=1)`. The tokenizer defaults to tiny_tokenizer()."""
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    vocab_size = config_overrides.pop("vocab_size", len(tokenizer))
    if vocab_size < len(tokenizer):
        raise ValueError(
            f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens); "
            f"omit vocab_size to match the tokenizer"
        )
    model = tiny_target(
        arch,
        seed=seed,
        dtype=dtype,
        vocab_size=vocab_size,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        **config_overrides,
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
