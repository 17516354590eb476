"""`HSPEC_LOOKUP=1`: splice prompt lookup into the HSPEC worker's draft blocks, as the reference engine's
`shipped+lookup` does (sglang_hspec/engine/drafters.py, LookupSpliceDrafter; docs/results.md, "Prompt lookup
spliced into the drafter").

Each request's lookup reads its host token history (`origin_input_ids + output_ids`, which ends with the
step's anchor once the previous step's result is processed) and never the drafter's output, so it runs on
the host while the drafter runs and the splice is one `torch.where` on the device: no sync. Two limits,
both checked:

- overlap scheduling (SGLang's default) processes a step's result after the next step is launched, so the
  host history lags the device by one step and every lookup would match a stale tail: the server must run
  with `--disable-overlap-schedule`;
- only blocks drafted by argmax are spliced (all-greedy batches, or SGLANG_DSPARK_USE_GREEDY_DRAFT=1), whose
  verify treats every draft as a deterministic proposal (one-hot q), which a spliced slot is. Blocks
  sampled from the drafter keep the drafter's tokens.
"""

from __future__ import annotations

import functools
import math

import torch

from sglang_hspec.engine.drafters import LOOKUP_CONFIDENCE, PromptLookup, splice_lookup

from .env import env_switch

LOOKUP_ENV = "HSPEC_LOOKUP"


def lookup_enabled(environ=None) -> bool:
    """`HSPEC_LOOKUP`: 1 splices, 0 or unset does not."""
    return env_switch(LOOKUP_ENV, environ, on="splice prompt lookup into the drafts", off="do not")


def check_lookup_server_args(server_args) -> None:
    """Launch check: the splice needs a host history that is current at propose time."""
    if not getattr(server_args, "disable_overlap_schedule", False):
        raise ValueError(f"{LOOKUP_ENV}=1 reads each request's token history on the host, which under overlap "
                         "scheduling lags the device by one step: launch with --disable-overlap-schedule, or drop "
                         f"{LOOKUP_ENV}")


def splice_lookup_into_argmax_blocks(proposer, *, block_size: int) -> None:
    """Wrap `proposer.propose` (DSpark's DraftBlockProposer, after `greedy_drafts_for_greedy_batches`, which
    sets `_greedy_draft` for the step) so that argmax-drafted blocks get the lookup's tokens after slot 1
    where the lookup agrees with the drafter's slot-1 token. The proposal's tensors are written in place:
    a folded proposal's are the draft sampler's own buffers, which later stages may read directly."""
    lookup = PromptLookup(block_size)
    propose = proposer.propose
    raw_logit = math.log(LOOKUP_CONFIDENCE / (1.0 - LOOKUP_CONFIDENCE))

    @functools.wraps(propose)
    def propose_with_lookup(*args, batch, **kwargs):
        proposal = propose(*args, batch=batch, **kwargs)  # launched; on a GPU the lookup overlaps it
        if not proposer._greedy_draft:
            return proposal
        drafted = proposal.draft_block.draft_tokens
        bs = drafted.shape[0]
        seqs = [list(req.origin_input_ids) + list(req.output_ids) for req in batch.reqs]
        looked, found = lookup.continuations((seqs + [[]] * bs)[:bs])  # rows without a request find nothing
        tokens, splice = splice_lookup(drafted=drafted, looked=looked.to(drafted.device, non_blocking=True),
                                       found=found.to(drafted.device, non_blocking=True))
        drafted.copy_(tokens)
        later = splice[:, None] & (torch.arange(block_size, device=drafted.device) >= 1)[None, :]
        if proposal.confidence is not None:
            proposal.confidence.masked_fill_(later, LOOKUP_CONFIDENCE)
        if proposal.confidence_raw is not None:
            proposal.confidence_raw.masked_fill_(later, raw_logit)
        if proposal.verify_ids is not None:  # [anchor | drafts] from the draft graph's tail
            proposal.verify_ids[:, 1:].copy_(tokens)
        return proposal

    proposer.propose = propose_with_lookup
