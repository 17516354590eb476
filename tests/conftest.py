import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# One thread: on 2 shared cores OpenMP oversubscription makes small ops 3-10x slower and noisy.
torch.set_num_threads(1)
