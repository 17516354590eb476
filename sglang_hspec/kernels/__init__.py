"""Kernels of our own. `paged_block_attention`: the draft block's attention over the target's paged KV
pool, read in place (Triton on CUDA, a torch reference elsewhere). Imports nothing above `target`."""

from .paged_block_attention import paged_block_attention, paged_block_attention_reference, triton_available
from .paged_kv import FP8_DTYPES, PagedKVWindow

__all__ = ["FP8_DTYPES", "PagedKVWindow", "paged_block_attention", "paged_block_attention_reference",
           "triton_available"]
