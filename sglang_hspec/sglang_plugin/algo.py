"""The HSPEC spec class: impersonates DSPARK for SGLang's scheduler and model runner.

`HSpecWorkerV2` inherits DSpark's proposer, heads, planner, verify/accept and overlap relay, so every
branch those read (`is_dspark()`, `is_dflash_family()`, ...) must answer as for DSPARK; see
docs/architecture.md ("Registration") for what reads each predicate. Imports SGLang: import this
module only from `register()`.
"""

from __future__ import annotations

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from . import server_args as _args
from .sglang_names import draft_worker_rows_per_request


class HSpecSpecAlgo(CustomSpecAlgo):
    # ---- DSpark-like predicates ----
    def is_dspark(self) -> bool:
        return True  # confidence relay, aux-hidden capture ids, tokens per request, DSpark metrics

    def is_dflash_family(self) -> bool:
        return True  # spec_prepare_for_decode, verify-graph spec info, FULL prefill capture

    def supports_target_verify_for_draft(self) -> bool:
        return True  # the block forward runs in TARGET_VERIFY mode

    def supports_ragged_verify(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        return True

    def supports_mixed_chunk(self) -> bool:
        return False  # v1

    def supports_prefill_shared_read_done(self) -> bool:
        return False  # v1

    def has_draft_kv(self) -> bool:
        return False  # the drafter reads the target's KV; (only sizing reads this: docs/architecture.md, "No drafter KV")

    # ---- the three methods CustomSpecAlgo lacks but the scheduler always calls ----
    def carries_draft_hidden_states(self) -> bool:
        return False  # EAGLE-family only (disaggregation transfer)

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def need_topk(self) -> bool:
        return False  # chain drafts, topk 1

    # ---- server arguments ----
    def handle_server_args(self, server_args) -> None:
        from sglang.srt.speculative.ragged_verify import read_ragged_verify_mode

        read_ragged_verify_mode()  # a typo'd SGLANG_RAGGED_VERIFY_MODE fails at startup, as for builtins
        _args.handle_server_args(server_args)

    def get_num_tokens_per_req_for_target_verify(self, rows_per_request: int, is_draft_worker: bool) -> int:
        # DSpark's rule, not inherited by CustomSpecAlgo: the draft block is one row fewer than the verify window.
        return draft_worker_rows_per_request(rows_per_request, is_draft_worker=is_draft_worker)


def worker_factory(server_args):
    from .worker import HSpecWorkerV2

    return HSpecWorkerV2


def register_algorithm() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    existing = get_spec(_args.ALGORITHM)
    if existing is not None:
        if not isinstance(existing, HSpecSpecAlgo):
            raise RuntimeError(f"speculative algorithm {_args.ALGORITHM} is already registered by another "
                               f"plugin ({type(existing).__module__}); keep one of them in SGLANG_PLUGINS")
        return
    SpeculativeAlgorithm.register(
        _args.ALGORITHM, supports_overlap=True, validate_server_args=_args.validate_server_args,
        spec_class=HSpecSpecAlgo,
    )(worker_factory)
