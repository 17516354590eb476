"""The pieces of a decode step without drafting read at stride 1 (`HSpecWorkerV2._forward_plain`).

A step where the speculation switch (speculation_switch.py) does not draft verifies each request's anchor
(the previous bonus token) alone. DSpark's decode path with the anchor-only stand-ins does that through its
gamma+1-wide bookkeeping: the compact logits and hidden states scattered into [bs * (gamma+1)] rows, an accept
over [bs, gamma+1] (sampled: a [bs, gamma, V] one-hot draft distribution and the chain sampler), a strided
context-row commit. Here one target forward over the anchors (below) is read at stride 1, one row per request:

- greedy rows: the bonus is the argmax of the anchor row after the same logit adjustments: the token the
  stand-in path (and plain decoding) emits;
- sampled rows: the bonus is drawn from the distribution DSpark's verify builds for that row (temperature,
  then top-k / top-p as `build_speculative_verify_target_probs`; min-p is not applied by DSpark's verify
  either). The stand-in path's chain sampler emits a token with exactly this distribution
  (speculation_switch.py, "Why it is lossless"), from another random stream;
- one token committed per request (the anchor), its context row written from the anchor's captured hidden
  states (the stand-in path's row commit_lens - 1 = 0), no confidences relayed.

The target forward: on CPU without a CUDA graph runner (the CPU tier), the anchors run as an ordinary DECODE
forward, what a server without speculation runs. Elsewhere, DSpark's ragged verify (TARGET_VERIFY, its
`_run_ragged`) over the anchors packed in the stand-ins' compact layout on a width-1 KV window: SGLang
captures the target's graphs in that mode only, and it replays them. `HSPEC_PLAIN_STEP_FORWARD=verify` takes
the verify forward on CPU too (what a GPU runs; the CPU tier tests both); the default is `auto`.

Imports SGLang: imported only from the worker inside the scheduler process.
"""

from __future__ import annotations

import torch
from sglang.kernels.ops.speculative.dspark.dspark_accept import SoftmaxTemp, _row_argmax
from sglang.kernels.ops.speculative.dspark.dspark_verify_window import RaggedVerifyWindow
from sglang.srt.speculative.dflash_utils import build_speculative_verify_target_probs

from .env import FORWARD_ENV, FORWARDS, plain_step_forward  # parsed without SGLang, for the launcher's check


def anchor_window(*, anchor: torch.Tensor, prefix_lens: torch.Tensor, write_loc: torch.Tensor,
                  num_tokens: int) -> RaggedVerifyWindow:
    """The packed verify rows of a width-1 window: request i's anchor at position prefix_lens[i], written to
    `write_loc[i]`, lane i of the window; lanes past the batch (a captured graph's padding) are token 0 at
    position 0, slot 0, window index -1 (the sink), as `BuildRaggedVerifyWindow` pads."""
    bs = anchor.shape[0]
    pad = num_tokens - bs
    lanes = torch.arange(bs, dtype=torch.int64, device=anchor.device)
    window = RaggedVerifyWindow(positions=prefix_lens.to(torch.int64), verify_cache_loc=write_loc,
                                verify_ids=anchor.to(torch.int64), window_index=lanes)
    if pad == 0:
        return window
    pad_with = torch.nn.functional.pad
    return RaggedVerifyWindow(positions=pad_with(window.positions, (0, pad)),
                              verify_cache_loc=pad_with(write_loc, (0, pad)),
                              verify_ids=pad_with(window.verify_ids, (0, pad)),
                              window_index=pad_with(lanes, (0, pad), value=-1))


def draw_anchor_bonus(*, logits: torch.Tensor, sampling_info, draft_input, fused_argmax: bool) -> torch.Tensor:
    """The next anchor of each request from its anchor row `logits` [bs, V] (logit adjustments applied): what
    DSpark's accept emits after zero accepted drafts. Greedy rows (top_k <= 1, SGLang's greedy mask) take
    the argmax; sampled rows draw from the verify distribution."""
    greedy = _row_argmax(logits, fused=fused_argmax)
    if sampling_info is None or sampling_info.is_all_greedy:
        return greedy
    bs = logits.shape[0]
    if not sampling_info.need_top_k_sampling and not sampling_info.need_top_p_sampling:
        probs = SoftmaxTemp.execute(logits=logits, temperatures=sampling_info.temperatures, rows_per_request=1)
    else:
        probs = build_speculative_verify_target_probs(
            next_token_logits=logits, sampling_info=sampling_info, draft_token_num=1, bs=bs,
            max_top_k=draft_input.max_top_k, uniform_top_k_value=draft_input.uniform_top_k_value,
        ).view(bs, -1)
    sampled = torch.multinomial(probs, 1).view(-1)
    if not sampling_info.is_any_greedy:
        return sampled
    return torch.where((sampling_info.top_ks <= 1).view(-1), greedy, sampled)


__all__ = ["FORWARD_ENV", "FORWARDS", "anchor_window", "draw_anchor_bonus", "plain_step_forward"]
