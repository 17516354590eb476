"""The boundary between our vocabulary and SGLang's: each SGLang name for one of our quantities is
converted here, in one function, and nowhere else (docs/architecture.md, "Glossary").

Our draft block length is `block_size` (draft tokens proposed per step; H-Spec: 7). SGLang calls it
`gamma` in its DSpark config and counts `speculative_num_draft_tokens` verify rows per request, which
include the anchor: block_size + 1. No SGLang import here."""

from __future__ import annotations


def sglang_num_draft_tokens(*, block_size: int) -> int:
    """SGLang's `speculative_num_draft_tokens`: verify rows per request (the anchor plus the block)."""
    return int(block_size) + 1


def block_size_from_num_draft_tokens(num_draft_tokens: int) -> int:
    """Inverse of `sglang_num_draft_tokens` (SGLang's server_info / step records report the rows)."""
    return int(num_draft_tokens) - 1


def block_size_from_gamma(gamma: int) -> int:
    """SGLang's DSpark `gamma` (draft slots per block) is our block_size, one for one."""
    return int(gamma)
