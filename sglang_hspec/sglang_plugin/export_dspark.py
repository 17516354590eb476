"""Export our `dspark` baseline drafter to SGLang's own DSpark checkpoint layout, so the builtin
`--speculative-algorithm DSPARK` serves it (docs/architecture.md, "Checkpoint format"; no SGLang import here).

    python -m sglang_hspec.sglang_plugin.export_dspark <save_drafter dir> <out dir> [--tokenizer-from <target>]

The math is the same, so no retraining: our layers are DFlash's (attention > MLP, context K/V from
hidden_norm(fc(target hidden)) through each layer's k/v projections, k_norm, RoPE), only the names
differ. Two layouts are folded exactly:
- hidden-state ids: SGLang captures each target layer once, in layer order; `fc` columns of repeated
  or unsorted ids are summed into that order;
- draft vocabulary: SGLang's Markov head spans the whole target vocabulary. W1 rows go by target id
  (ids outside the draft vocabulary share our spare row); one extra rank column, constant 1 in W1 and
  -1e4 in W2 for ids outside the draft vocabulary, keeps them from being proposed (the confidence
  head's weight for that column is 0, so confidence is unchanged).
Limits: the drafter must have q/k norms (`qk_norm`: SGLang's DFlash layers always apply them, per head
before RoPE, as ours do); that is the target's choice by default (Qwen3 has them, Llama / SmolLM2 not) and
the DFlash-family recipes set it for any target (configs/train_dspark_smollm2.yaml). SGLang's DSpark
attends the whole context where ours stops at `sliding_window` (2048): identical below that length.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sglang_hspec.model.checkpoint import sglang_capture_ids
from sglang_hspec.model.config import HSpecConfig

OUTSIDE_VOCAB_BIAS = -1.0e4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def dspark_config(cfg: HSpecConfig, *, markov_rank: int) -> dict:
    t = cfg.target
    n = cfg.num_layers
    capture = sglang_capture_ids(cfg)
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": t.model_type,
        "hidden_size": t.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": n,
        "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim, "vocab_size": t.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": t.rope_theta, **{"rope_type": "default", **t.rope_scaling}},
        "max_position_embeddings": t.max_position_embeddings, "tie_word_embeddings": False,
        # full attention layers -> SGLang runs the draft block non-causally, as our dspark does
        "layer_types": ["full_attention"] * n,
        "block_size": cfg.block_size, "num_target_layers": t.num_hidden_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": capture,
                          "block_size": cfg.block_size, "num_target_layers": t.num_hidden_layers},
        "markov_rank": markov_rank, "markov_head_type": "vanilla",
        "enable_confidence_head": cfg.confidence_head, "confidence_head_with_markov": True,
        "sample_from_anchor": True,  # slot j predicts anchor + j + 1 (our SLOT_CONVENTION)
    }


def dspark_weights(cfg: HSpecConfig, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """Our dspark state_dict -> SGLang DSpark tensors (+ the exported Markov rank)."""
    t, H = cfg.target, cfg.hidden_size
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "input_layernorm.weight"] = state[p + "attn_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = state[p + "mlp_norm.weight"]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[q + f"self_attn.{name}.weight"] = state[p + f"attn.{name}.weight"]
        for name in ("q_norm", "k_norm"):
            out[q + f"self_attn.{name}.weight"] = state[p + f"attn.{name}.weight"]
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[q + f"mlp.{name}.weight"] = state[p + f"mlp.{name}.weight"]
    out["model.norm.weight"] = state["norm.weight"]
    out["model.hidden_norm.weight"] = state["hidden_norm.weight"]
    capture = sglang_capture_ids(cfg)
    fc = state["fc.weight"].float()
    folded = torch.zeros(H, len(capture) * H)
    for j, layer_id in enumerate(cfg.target_layer_ids):  # repeated ids see the same captured rows: sum
        c = capture.index(layer_id)
        folded[:, c * H:(c + 1) * H] += fc[:, j * H:(j + 1) * H]
    out["model.fc.weight"] = folded.to(state["fc.weight"].dtype)

    d2t = state["d2t"].long()
    V, Vd, r = t.vocab_size, cfg.draft_vocab_size, cfg.markov_rank
    t2d = torch.full((V,), Vd, dtype=torch.long)
    t2d[d2t] = torch.arange(Vd)
    w1, w2 = state["markov.markov_w1.weight"], state["markov.markov_w2.weight"]
    masked = Vd < V
    rank = r + int(masked)
    w1_full = torch.zeros(V, rank, dtype=w1.dtype)
    w1_full[:, :r] = w1[t2d]
    w2_full = torch.zeros(V, rank, dtype=w2.dtype)
    w2_full[d2t, :r] = w2
    if masked:
        w1_full[:, r] = 1.0
        outside = torch.ones(V, dtype=torch.bool)
        outside[d2t] = False
        w2_full[outside, r] = OUTSIDE_VOCAB_BIAS
    out["markov_head.markov_w1.weight"] = w1_full
    out["markov_head.markov_w2.weight"] = w2_full
    if cfg.confidence_head:
        w = state["confidence.weight"].float()  # [1, H + r]
        out["confidence_head.proj.weight"] = torch.cat([w, w.new_zeros(1, rank - r)], dim=1)
        out["confidence_head.proj.bias"] = state["confidence.bias"].float()
    return {k: v.contiguous() for k, v in out.items()}, rank


def export_dspark(src: str | Path, dst: str | Path, *, tokenizer_from: str | Path | None = None) -> Path:
    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    if "hspec" not in raw:
        raise ValueError(f"{src}/config.json has no 'hspec' section; pass a save_drafter checkpoint directory")
    cfg = HSpecConfig.from_dict(raw["hspec"])
    if cfg.kind != "dspark":
        raise ValueError(f"{src} holds a {cfg.kind!r} drafter; only 'dspark' maps onto SGLang's DSpark "
                         "(H-Spec drafters are served with --speculative-algorithm HSPEC as they are)")
    if not cfg.qk_norm:
        raise ValueError(f"{src} holds a dspark drafter without q/k norms (qk_norm false; trained for a "
                         f"{cfg.target.model_type} target); SGLang's DSpark layers always apply them, so it cannot "
                         "export exactly: retrain it with model.drafter.qk_norm: true "
                         "(configs/train_dspark_smollm2.yaml does)")
    if any("M" in layer or "A" not in layer for layer in cfg.layer_pattern):
        raise ValueError(f"{src} has layer_pattern {list(cfg.layer_pattern)}; every SGLang DSpark layer is "
                         "attention > MLP ('AF'), without Mamba: retrain with the default dspark pattern")
    if cfg.markov_rank <= 0:
        raise ValueError("SGLang's DSpark needs a Markov head (markov_rank > 0)")
    last = cfg.target.num_hidden_layers - 1
    if last in cfg.target_layer_ids:
        raise ValueError(f"target_layer_ids {list(cfg.target_layer_ids)} read layer {last}'s output, which "
                         "SGLang never captures; retrain with ids below it")
    weights, rank = dspark_weights(cfg, load_file(str(src / "model.safetensors")))
    dst.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(dspark_config(cfg, markov_rank=rank), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        for d in (src, Path(tokenizer_from) if tokenizer_from else None):
            if d is not None and (d / name).exists():
                shutil.copy(d / name, dst / name)
                break
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="our dspark checkpoint (save_drafter: config.json + model.safetensors)")
    ap.add_argument("dst", help="output directory (SGLang DSpark layout)")
    ap.add_argument("--tokenizer-from", help="copy tokenizer files from this dir (e.g. the target) if src has none")
    a = ap.parse_args(argv)
    print(export_dspark(a.src, a.dst, tokenizer_from=a.tokenizer_from))


if __name__ == "__main__":
    main()
