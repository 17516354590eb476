"""Where there is no GPU, the Triton kernels run under Triton's interpreter (numpy, on CPU tensors).
Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is imported, so it is set
here, before any test imports one; with CUDA present the tests compile and run the real kernel."""

import importlib.util
import os

import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
