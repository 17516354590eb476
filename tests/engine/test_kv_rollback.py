import torch

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.drafters import RandomDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.target.adapter import TargetAdapter


class KVCheckingDrafter(RandomDrafter):
    """At every propose, compares the engine's rolled-back cache with a from-scratch recompute of
    the committed prefix (all layers), then proposes random tokens (many rejections)."""

    kv_layer_ids = (0, 3)
    sliding_window = 5

    def __init__(self, adapter, vocab):
        super().__init__(vocab, block_size=4)
        self.adapter = adapter
        self.checks = 0

    def propose(self, ctx, sampling, generator=None):
        cache = self.adapter.cache
        for b, hist in enumerate(ctx.token_history):
            row = int(ctx.row_ids[b])
            n = len(hist)
            assert int(cache.lengths[row]) == n
            assert int(ctx.last_position[b]) == n - 1
            ref = self.adapter.full_forward(torch.tensor([hist]), kv_layer_ids=range(self.adapter.num_layers))
            for lid, (k_ref, v_ref) in ref.kv.items():
                layer = cache.layers[lid]
                torch.testing.assert_close(layer.keys[row, :, :n], k_ref[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(layer.values[row, :, :n], v_ref[0], atol=1e-5, rtol=1e-4)
            # the drafter's window view reads exactly the last W committed positions
            view = ctx.kv_views[3]
            k, _ = view.select(torch.tensor([b])).gather()
            w = min(self.sliding_window, n)
            torch.testing.assert_close(k[0, :, -w:], ref.kv[3][0][0, :, n - w:n], atol=1e-5, rtol=1e-4)
            assert view.valid[b].sum() == w
            self.checks += 1
        return super().propose(ctx, sampling, generator)


def test_rolled_back_kv_equals_recompute():
    model = tiny_target("qwen3", vocab_size=48, num_layers=4)
    adapter = TargetAdapter(model)
    drafter = KVCheckingDrafter(adapter, 48)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=0, ignore_eos=True)
    SpeculativeEngine(adapter, drafter).generate([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], params)
    assert drafter.checks >= 10
