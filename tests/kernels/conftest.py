"""Where there is no GPU, the Triton kernels run under Triton's interpreter (numpy, on CPU tensors).
Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is imported, so it is set
here, before any test imports one; with CUDA present the tests compile and run the real kernel.

No __init__.py in this folder: tests/ is on sys.path, and a package `kernels` here would shadow Hugging
Face's `kernels`, which transformers imports at startup (tests/test_architecture.py checks that no test
package does); the helpers are imported by bare name (`from _pool import ...`)."""

import importlib.util
import os

import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
