"""Test drafters shared by the engine tests."""

import torch

from sglang_hspec.core.types import DraftProposal


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


class OracleDrafter:
    """Proposes the true greedy continuation for its first `good` slots, then garbage: exercises
    partial acceptance at every slot."""

    name = "oracle"
    target_layer_ids = ()
    kv_layer_ids = ()
    sliding_window = 1

    def __init__(self, model, block_size, good):
        self.model, self.block_size, self.good = model, block_size, good

    def propose(self, ctx, sampling, generator=None):
        rows = []
        for hist, anchor in zip(ctx.token_history, ctx.anchor_tokens.tolist()):
            cont = hf_greedy(self.model, hist + [anchor], self.good)
            rows.append(cont + [0] * (self.block_size - self.good))
        return DraftProposal(tokens=torch.tensor(rows))

    def reset(self):
        pass
