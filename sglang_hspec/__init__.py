"""sglang-hspec: H-Spec speculative decoding (hybrid Mamba-attention block drafter that keeps no
drafter-side KV cache), a reference engine on Hugging Face targets, and an SGLang plugin."""

import os as _os

# Never reach a model hub at run time: every asset ships inside an installed package.
_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__version__ = "0.1.0"
