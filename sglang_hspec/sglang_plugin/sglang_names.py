"""The boundary between our vocabulary and SGLang's: each SGLang name for one of our quantities is
converted here, in one function, and nowhere else (docs/architecture.md, "Glossary").

Our draft block length is `block_size` (draft tokens proposed per step; H-Spec: 7). SGLang calls it
`gamma` in its DSpark config and counts `speculative_num_draft_tokens` verify rows per request, which
include the anchor: block_size + 1. No SGLang import here."""

from __future__ import annotations

from typing import Any


def sglang_num_draft_tokens(*, block_size: int) -> int:
    """SGLang's `speculative_num_draft_tokens`: verify rows per request (the anchor plus the block)."""
    return int(block_size) + 1


def block_size_from_num_draft_tokens(num_draft_tokens: int) -> int:
    """Inverse of `sglang_num_draft_tokens` (SGLang's server_info / step records report the rows)."""
    return int(num_draft_tokens) - 1


def block_size_from_gamma(gamma: int) -> int:
    """SGLang's DSpark `gamma` (draft slots per block) is our block_size, one for one."""
    return int(gamma)


def block_size_of(dspark: Any) -> int:
    """The block size of a DSpark object that carries SGLang's `gamma`: its worker, its block proposer, its
    planner config."""
    return block_size_from_gamma(dspark.gamma)


def sglang_verify_lens(layout: Any):
    """A ragged verify layout's `verify_lens` (per request: verify_length + 1, the anchor counts), for SGLang
    calls that take them as they are."""
    return layout.verify_lens


def given_num_draft_tokens(server_args: Any) -> int | None:
    """`--speculative-num-draft-tokens` as the user gave it (verify rows per request), None when not given."""
    explicit = getattr(server_args, "speculative_num_draft_tokens", None)
    return None if explicit is None else int(explicit)


def set_server_block_size(server_args: Any, *, block_size: int) -> None:
    """Tell SGLang the block size: it counts verify rows per request, `speculative_num_draft_tokens`."""
    server_args.speculative_num_draft_tokens = sglang_num_draft_tokens(block_size=block_size)


def draft_worker_rows_per_request(sglang_rows_per_request: int, *, is_draft_worker: bool) -> int:
    """SGLang's target-verify rows per request (`speculative_num_draft_tokens`, block_size + 1) as the draft
    worker counts them: the anchor and block_size - 1 masks (slot j predicts anchor + j + 1), block_size rows."""
    block_size = block_size_from_num_draft_tokens(sglang_rows_per_request)
    return block_size if is_draft_worker else sglang_num_draft_tokens(block_size=block_size)
