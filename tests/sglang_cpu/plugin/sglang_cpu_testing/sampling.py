"""Fix 7: a torch port of SGLang's classic chain speculative-sampling kernel
(`sglang/kernels/ops/speculative/reject_sampling.py`, `speculative_sampling_classic_kernel`), for CPU
tests. Same signature as `chain_speculative_sampling_triton`; block verification is not ported.

Per request: draft token j is accepted iff its draft probability q is a probability (0 < q <= 1) and
u_j * q < p (target probability, step uniform u_j); stop at the first rejection. The final token comes
from p if every draft was accepted, else from max(p - q, 0), by CDF inversion with the final uniform.
"""

from __future__ import annotations

import torch


def chain_speculative_sampling_torch(
    predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
    retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs,
    threshold_single=None, threshold_acc=None, deterministic=True, *, block_verification: bool = False,
):
    if block_verification:
        raise NotImplementedError("sglang_cpu_testing: block verification sampling is not ported to CPU")
    batch_size, num_slots = candidates.shape
    vocab = target_probs.shape[-1]
    final_u = uniform_samples_for_final_sampling.reshape(-1)
    for b in range(batch_size):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        num_accept, row = 0, 0
        for step in range(1, num_slots):
            tok = int(candidates[b, step])
            p = float(target_probs[b, row, tok])
            q = float(draft_probs[b, row, tok])
            if not (0.0 < q <= 1.0 and float(uniform_samples[b, step - 1]) * q < p):
                break
            num_accept += 1
            row = step
            predicts[last] = tok
            last = int(retrive_index[b, step])
            accept_index[b, num_accept] = last
        accept_token_num[b] = num_accept
        p_row = target_probs[b, row].float()
        if num_accept == num_slots - 1:
            mass = p_row
        else:
            q_row = draft_probs[b, row].float()
            q_row = torch.where((q_row >= 0) & (q_row <= 1), q_row, torch.zeros_like(q_row))
            mass = (p_row - q_row).clamp_min(0)
        cdf = torch.cumsum(mass, 0)
        hit = torch.nonzero(cdf > float(final_u[b]) * float(cdf[-1]))
        predicts[last] = int(hit[0, 0]) if hit.numel() else vocab - 1
    return None
