"""Tiny checkpoints for the SGLang CPU tier (tests/sglang_cpu/README.md, "Tiny checkpoints").

Built in code in a few seconds, written as HF `config.json` + safetensors + tokenizer files so that
SGLang loads them as it would any model directory. Deterministic: same seed -> same bytes.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Prompts the bigram draft is fitted on and the end-to-end tests send.
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Parser:\n    def __init__(self",
    "for i in range(10):",
    "The quick brown fox",
    "return self._cache[key]",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _atomic_dir(out: Path, build) -> Path:
    """Build into a sibling temp dir, then rename, so a crash never leaves a half-written checkpoint."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def build_tokenizer(out_dir: Path, *, num_files: int = 60):
    """Byte-level BPE (vocab 1024) trained on stdlib sources; saved as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))[:num_files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_qwen2_config(**overrides):
    """The tiny Qwen3 geometry as a Qwen2 model (q/k/v biases, no q/k norms; head_dim = 128 / 4 = 32)."""
    from transformers import Qwen2Config

    kw = dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6,
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def tiny_llama_config(**overrides):
    """The tiny Qwen3 geometry as a Llama model (SmolLM2's family: no q/k norms, no biases), 3 layers so that a
    drafter can read two captured layers (SGLang never captures the last one)."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def build_tiny_target(out: Path, *, seed: int = 0, logit_scale: int = 1, family: str = "qwen3") -> Path:
    """Qwen3ForCausalLM, 2 layers, H=128, 4 q / 2 kv heads, head_dim 32, V=1024, bf16 (1.1 MB); with
    `family="qwen2"` the same geometry as a Qwen2ForCausalLM (tiny_qwen2_config).

    `logit_scale` (a power of two, so the bf16 weights scale exactly) multiplies the LM head: the target
    then samples at temperature T what the unscaled one samples at T / logit_scale, with the same greedy
    path. Sampling tests use it to run at temperature 1, where the unscaled random target is near-flat.
    `family="llama"`: a 3-layer LlamaForCausalLM of the same widths (tiny_llama_config)."""
    from transformers import AutoModelForCausalLM

    if logit_scale < 1 or logit_scale & (logit_scale - 1):
        raise ValueError(f"logit_scale must be a power of two (exact in bf16), got {logit_scale}")

    def build(tmp: Path) -> None:
        cfg = {"qwen3": tiny_qwen3_config, "qwen2": tiny_qwen2_config, "llama": tiny_llama_config}[family]()
        # std 0.2 instead of 0.02: peaked next-token distributions, so greedy ties (and bf16 near-ties)
        # are rare and a wrong token shows up quickly.
        cfg.initializer_range = 0.2
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
        model.save_pretrained(tmp)
        build_tokenizer(tmp)

    return _atomic_dir(out, build)


def load_target(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def hf_greedy(target_dir: Path, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation ids from HF transformers in float32 (the golden reference)."""
    model, tok = load_target(target_dir), load_tokenizer(target_dir)
    out = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _dspark_config(target_dir: Path, *, block_size: int, markov_rank: int) -> dict:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    n_target = cfg["num_hidden_layers"]
    cfg.update(
        architectures=["Qwen3DSparkModel"], model_type="qwen3", num_hidden_layers=1,
        layer_types=["full_attention"], block_size=block_size, num_target_layers=n_target,
        # Capture id 0 is taken before target layer 1 (SGLang adds 1), so K=1 and fc is [H, H].
        dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": [0], "block_size": block_size,
                       "num_target_layers": n_target},
        markov_rank=markov_rank, markov_head_type="vanilla", enable_confidence_head=True,
        confidence_head_with_markov=True, sample_from_anchor=True, tie_word_embeddings=False,
    )
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def _dspark_weights(cfg: dict, *, seed: int, markov_w1=None, markov_w2=None) -> dict[str, torch.Tensor]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    k = len(cfg["dflash_config"]["target_layer_ids"])
    r = cfg["markov_rank"]
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
    p = "model.layers.0."
    w = {
        p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
        p + "self_attn.q_proj.weight": rnd(nq * hd, h), p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
        p + "self_attn.v_proj.weight": rnd(nkv * hd, h), p + "self_attn.o_proj.weight": rnd(h, nq * hd),
        p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
        p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
        p + "mlp.down_proj.weight": rnd(h, inter),
        "model.norm.weight": ones(h), "model.hidden_norm.weight": ones(h), "model.fc.weight": rnd(h, k * h),
        "markov_head.markov_w1.weight": rnd(v, r) if markov_w1 is None else markov_w1.to(torch.bfloat16),
        "markov_head.markov_w2.weight": rnd(v, r) if markov_w2 is None else markov_w2.to(torch.bfloat16),
        # float32: SGLang builds the confidence head in fp32 (only in non-static modes; shipping it
        # lets one checkpoint serve every mode).
        "confidence_head.proj.weight": torch.randn(1, h + r, generator=g) * 0.02,
        "confidence_head.proj.bias": torch.zeros(1),
    }
    return {name: t.contiguous() for name, t in w.items()}


def _write_draft(out: Path, target_dir: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> None:
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights, str(out / "model.safetensors"))
    for name in TOKENIZER_FILES:
        if (Path(target_dir) / name).exists():
            shutil.copy(Path(target_dir) / name, out / name)


def build_dspark_draft(out: Path, target_dir: Path, *, block_size: int = 3, seed: int = 1) -> Path:
    """A random DSpark draft (1 layer, Markov rank 16): exercises every stage, accepts little."""

    def build(tmp: Path) -> None:
        cfg = _dspark_config(target_dir, block_size=block_size, markov_rank=16)
        _write_draft(tmp, target_dir, cfg, _dspark_weights(cfg, seed=seed))

    return _atomic_dir(out, build)


@torch.no_grad()
def bigram_table(target_dir: Path, prompts: list[str], *, max_new_tokens: int = 64) -> torch.Tensor:
    """next[prev] = the most frequent successor of `prev` in the target's greedy continuations of
    `prompts`; tokens never seen there get the target's argmax given that token alone."""
    model, tok = load_target(target_dir), load_tokenizer(target_dir)
    v = model.config.vocab_size
    alone = model(torch.arange(v)[:, None]).logits[:, -1].argmax(-1)
    counts: dict[int, Counter] = {}
    for p, seq in zip(prompts, hf_greedy(target_dir, prompts, max_new_tokens)):
        # The prompt's last token precedes the first generated one.
        seq = [tok.encode(p)[-1], *seq]
        for a, b in zip(seq[:-1], seq[1:]):
            counts.setdefault(a, Counter())[b] += 1
    nxt = alone.clone()
    for a, c in counts.items():
        nxt[a] = c.most_common(1)[0][0]
    return nxt


def build_bigram_draft(out: Path, target_dir: Path, *, prompts: list[str] = PROMPTS, block_size: int = 3,
                       seed: int = 1, strength: float = 30.0) -> Path:
    """A DSpark draft whose Markov head (rank V: w1 = I, w2[next, prev] = strength) proposes the
    target's own greedy bigram continuation, forcing real multi-token acceptance. Rebuild it whenever
    the target changes."""

    def build(tmp: Path) -> None:
        cfg = _dspark_config(target_dir, block_size=block_size, markov_rank=VOCAB)
        nxt = bigram_table(target_dir, prompts)
        w1 = torch.eye(VOCAB)
        w2 = torch.zeros(VOCAB, VOCAB)
        w2[nxt, torch.arange(VOCAB)] = strength
        _write_draft(tmp, target_dir, cfg, _dspark_weights(cfg, seed=seed, markov_w1=w1, markov_w2=w2))

    return _atomic_dir(out, build)


def build_hspec_draft(out: Path, target_dir: Path, *, block_size: int = 3, seed: int = 2, bigram: bool = False,
                      strength: float = 30.0) -> Path:
    """A random-init H-Spec drafter for the tiny target, written by our own `save_drafter` (config.json +
    model.safetensors, exactly what the trainer writes) plus the target's tokenizer files. Hidden-state
    ids are all 0: SGLang captures the input of layer id + 1, so a 2-layer target offers layer 0 only;
    the attention layers read target KV layers 0 and 1. Draft vocabulary 999 of 1024 (ids outside it
    must never be proposed). With `bigram`, the Markov head (rank V_d + 1, W1 = I) proposes the target's
    own greedy bigrams (see build_bigram_draft), so acceptance through the whole HSPEC path is real."""
    from sglang_hspec.model.checkpoint import build_drafter, save_drafter
    from sglang_hspec.model.config import HSpecConfig
    from sglang_hspec.target.geometry import TargetGeometry

    def build(tmp: Path) -> None:
        target = load_target(target_dir)
        geometry = TargetGeometry.from_hf_config(target.config)
        cfg = HSpecConfig(target=geometry, target_layer_ids=(0,) * 5, kv_reuse_layer_ids=(0, 1, 1),
                          mask_token_id=VOCAB - 1, intermediate_size=256, block_size=block_size,
                          mamba_num_heads=4, mamba_head_dim=16, mamba_groups=2, fusion_rank=64,
                          draft_vocab_size=999, markov_rank=1000 if bigram else 16)
        nxt = bigram_table(target_dir, PROMPTS) if bigram else None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_drafter("hspec", cfg, target.get_input_embeddings(), target.get_output_embeddings())
            # the Markov W2 starts at zero (no bias); a random one exercises the full-vocabulary layout
            torch.nn.init.normal_(model.markov.markov_w2.weight, std=0.5)
            # a draft vocabulary that is not a prefix: every 41st id is left out, the mask id kept
            keep = [i for i in range(VOCAB) if i % 41 != 5]
            model.set_draft_vocab(torch.tensor(keep))
        if nxt is not None:
            with torch.no_grad():
                draft = model.to_draft_ids(torch.arange(VOCAB))  # V_d (W1's spare row) outside
                model.markov.markov_w1.weight.copy_(torch.eye(1000))
                w2 = torch.zeros(999, 1000)
                inside = draft[nxt] < 999  # successors outside the draft vocabulary cannot be proposed
                w2[draft[nxt][inside], draft[inside]] = strength
                model.markov.markov_w2.weight.copy_(w2)
        save_drafter(model, tmp)
        for name in TOKENIZER_FILES:
            if (Path(target_dir) / name).exists():
                shutil.copy(Path(target_dir) / name, tmp / name)

    return _atomic_dir(out, build)


def build_exported_dspark_draft(out: Path, target_dir: Path, *, block_size: int = 3, seed: int = 3) -> Path:
    """Our `dspark` baseline (random init, save_drafter, draft vocabulary 999 of 1024) exported to
    SGLang's DSpark layout by sglang_hspec.sglang_plugin.export_dspark. Hidden-state ids (0, 0, 0, 0, 0):
    the exporter folds the repeated fc columns into SGLang's single capture of layer 0."""
    from sglang_hspec.model.checkpoint import build_drafter, save_drafter
    from sglang_hspec.model.config import HSpecConfig
    from sglang_hspec.sglang_plugin.export_dspark import export_dspark
    from sglang_hspec.target.geometry import TargetGeometry

    def build(tmp: Path) -> None:
        target = load_target(target_dir)
        cfg = HSpecConfig(target=TargetGeometry.from_hf_config(target.config), target_layer_ids=(0,) * 5,
                          mask_token_id=VOCAB - 1, intermediate_size=256, block_size=block_size,
                          mamba_num_heads=4, draft_vocab_size=999, markov_rank=16)  # kind dspark drops Mamba
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_drafter("dspark", cfg, target.get_input_embeddings(), target.get_output_embeddings())
            torch.nn.init.normal_(model.markov.markov_w2.weight, std=0.5)
            model.set_draft_vocab(torch.tensor([i for i in range(VOCAB) if i % 41 != 5]))
        save_drafter(model, tmp / "ours")
        export_dspark(tmp / "ours", tmp, tokenizer_from=target_dir)
        shutil.rmtree(tmp / "ours")

    return _atomic_dir(out, build)


def build_dspark_baseline(out: Path, target_dir: Path, *, target_layer_ids=(0,) * 5, qk_norm: bool | None = True,
                          block_size: int = 3, seed: int = 4) -> Path:
    """Our `dspark` baseline for a tiny target as `save_drafter` writes it (random init, draft vocabulary 999
    of 1024), with q/k norms by default whatever the target (`qk_norm`). Every weight the exporter maps is
    moved off its init (norm weights around 1, a non-zero Markov W2), so a norm applied in the wrong place,
    or a weight mapped to the wrong name, changes the proposals."""
    from sglang_hspec.model.checkpoint import build_drafter, save_drafter
    from sglang_hspec.model.config import HSpecConfig
    from sglang_hspec.target.geometry import TargetGeometry

    def build(tmp: Path) -> None:
        target = load_target(target_dir)
        cfg = HSpecConfig(target=TargetGeometry.from_hf_config(target.config), target_layer_ids=target_layer_ids,
                          mask_token_id=VOCAB - 1, intermediate_size=256, block_size=block_size, qk_norm=qk_norm,
                          draft_vocab_size=999, markov_rank=16, kind="dspark")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_drafter("dspark", cfg, target.get_input_embeddings(), target.get_output_embeddings())
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.copy_(1 + 0.3 * torch.randn_like(p))
                torch.nn.init.normal_(model.markov.markov_w2.weight, std=0.5)
            model.set_draft_vocab(torch.tensor([i for i in range(VOCAB) if i % 41 != 5]))
        save_drafter(model, tmp)

    return _atomic_dir(out, build)
