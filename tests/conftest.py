import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# One thread: on 2 shared cores OpenMP oversubscription makes small ops 3-10x slower and noisy.
torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def embedded_dir():
    """The converted SmolLM2 cache (honours $HSPEC_CACHE_DIR); converts once per machine, ~30 s."""
    from sglang_hspec.assets.embedded import embedded_target_dir

    return embedded_target_dir()


@pytest.fixture(scope="session")
def embedded_target(embedded_dir):
    """(model, tokenizer) in bf16, as stored in the cache."""
    from sglang_hspec.assets.embedded import load_embedded_target

    return load_embedded_target()


@pytest.fixture(scope="session")
def embedded_adapter_fp32(embedded_dir):
    """The embedded target as a TargetAdapter in float32: exact-equality tests avoid bf16 near-ties,
    and on AVX2-only CPUs fp32 is also the fast dtype."""
    from sglang_hspec.assets.embedded import load_embedded_target
    from sglang_hspec.target.adapter import TargetAdapter

    model, tokenizer = load_embedded_target(dtype=torch.float32)
    return TargetAdapter(model, tokenizer=tokenizer)
