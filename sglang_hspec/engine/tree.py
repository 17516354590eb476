"""Tree verification from one drafter forward (reference engine).

One step per request: the drafter runs once; a tree of at most `TreeSpec.max_rows` verify rows (the anchor
included) is built from it; the target verifies every node in one forward (`TargetAdapter.extend_tree`:
each node attends to the committed prefix and its own ancestors); the acceptance walk keeps one root-to-node
path and draws the next anchor; `TargetAdapter.commit_path` moves the path's K/V into place (O(accepted)) and
drops the rest of the tree in O(1).

The tree (`build_tree`), best first by an estimate of the probability that the target reaches and keeps
each node:
- the main branch, always included: the chain the engine would verify, i.e. the drafter's own chain (the
  H-Spec drafter: the argmax, or at T > 0 a draw from q, of the Markov-conditioned distribution of each
  slot given the previous slot's token), or, where a `LookupSpliceDrafter`'s lookup agrees with the
  drafter's slot-1 token, the splice's chain (slot 1, then the lookup's tokens);
- siblings: the next most likely tokens of a node's distribution, and under each sibling its own most
  likely continuation (the H-Spec drafter's Markov head conditions slot j + 1 on the sibling's token; a
  drafter without one gives the block distribution of the next slot);
- elsewhere the prompt-lookup continuation (`PromptLookup`) as one more branch, merged into the tree where
  it agrees with it.
The estimates come from the confidences (calibrated when a transform is given): c_u, the confidence of
node u's slot given u's token, for u's most likely child; (1 - c_u) q(x) / (1 - q(top-1)) for another
child x; LOOKUP_CONFIDENCE for a lookup token (times 1 - c_u beside a model child). They only order
and size the tree (`TreeSpec.min_value` drops nodes below it); they never enter the acceptance.

Acceptance (`accept_tree_greedy`, `accept_tree_sampling`). Greedy: from the root follow the child whose
token is the target's argmax; at the first node without one, the argmax is the next token. Sampling: the
multi-candidate rule (recursive rejection over siblings, as in SpecInfer), `resolve_node`: at a node with
target law p and children c_1..c_m in their order, with p_1 = p, candidate i is kept with probability
min(1, p_i(c_i) / q_i(c_i)), else p_{i+1} = normalise((p_i - q_i)+); when every child is rejected the token
is drawn from p_{m+1}. A child drawn from the drafter's q has q_i = q; a deterministic child (top-k
sibling, lookup token, greedy chain) is a point mass, q_i = 1[c_i]: kept with probability p_i(c_i), else
p_{i+1} = p_i with c_i zeroed, renormalised.

Why it is exact. Claim: the token a node emits has law p, if candidate i was drawn from q_i given
everything drawn before it (earlier candidates, the tree above) and independently of the target's coins.
By induction on the candidates left: candidate i emits x directly with probability q_i(x) min(1,
p_i(x)/q_i(x)) = min(p_i(x), q_i(x)), and is rejected with probability sum_x (p_i - q_i)+(x); given the
rejection and c_1..c_i, the rest of the procedure emits p_{i+1} (induction, its proposals again drawn
given what came before; p_{i+1} does not depend on the value c_i); the total is min(p_i, q_i)(x) +
(p_i - q_i)+(x) = p_i(x). At the last step the draw from p_{m+1} is exact by definition. A kept child
continues the walk at its own node with the target's law given the path so far, and its children were
drawn given that path, so the emitted sequence follows the target's chain rule: the target's own law.
The condition that matters is "drawn from q_i": a candidate that was drawn and then kept or dropped
depending on its own token is not a draw from q_i. So only the main branch is ever sampled (and always
included, whatever its tokens); every other node is deterministic given the drafter's output and the
earlier draws (which may decide it: a sibling is "the best token other than the sampled one"), and is
verified as a point mass. tests/engine/test_tree_acceptance.py checks the output law with a chi-square
test and shows it fails for three wrong rules (its docstring gives the power); docs/tree.md.

`SpeculativeEngine(..., tree=TreeSpec(...))` (engine/engine.py) runs these pieces as its step
(`TreeVerifier.step`, the one call per step) for drafters without a drafter-side cache.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sglang_hspec.core.sampling import sample_from, sampling_probs
from sglang_hspec.core.types import DraftContext, SamplingParams
from sglang_hspec.engine.drafters import LOOKUP_CONFIDENCE, LookupSpliceDrafter, PromptLookup
from sglang_hspec.target.adapter import TargetAdapter

# verify rows per request by default: on an AMX Xeon a bf16 verify of 16 rows costs 82.5 ms against 74.2 ms
# for the chain's 8 (1 row: 65.8 ms), so the 8 extra rows cost about one eighth of a step
DEFAULT_TREE_ROWS = 16


@dataclass(frozen=True)
class TreeSpec:
    """max_rows: verify rows per request, the anchor included (>= 1; 1 = plain decoding). max_children:
    children per node. min_value: nodes whose estimated probability of being reached and kept is below it
    are left out (0 fills max_rows). lookup: add the prompt-lookup branch when the drafter carries one.
    sps_table: an SPS table of the target's verify forwards (`hspec profile-sps`); given, each step keeps of
    every tree only the nodes that raise expected tokens x steps/s (`size_trees`)."""

    max_rows: int = DEFAULT_TREE_ROWS
    max_children: int = 4
    min_value: float = 0.0
    lookup: bool = True
    sps_table: str | None = None

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError(f"TreeSpec.max_rows must be >= 1 (the anchor's row), got {self.max_rows}")
        if self.max_children < 1:
            raise ValueError(f"TreeSpec.max_children must be >= 1, got {self.max_children}")
        if not 0.0 <= self.min_value <= 1.0:
            raise ValueError(f"TreeSpec.min_value must lie in [0, 1], got {self.min_value}")


@dataclass
class DraftTree:
    """Nodes in topological order; node 0 is the root (the anchor). proposals[i]: the distribution over the
    target vocabulary node i's token was drawn from, None for a deterministic node (a point mass)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    proposals: list[torch.Tensor | None]
    values: list[float]
    kinds: list[str]  # root | main | sibling | lookup
    children: list[list[int]] = field(default_factory=list)
    forced: int = 1  # nodes 0..forced-1: the root and the main branch, verified whatever the sizing

    @classmethod
    def root(cls, anchor: int) -> DraftTree:
        return cls([int(anchor)], [-1], [0], [None], [1.0], ["root"], [[]])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, *, proposal: torch.Tensor | None, value: float, kind: str) -> int:
        if self.child_with(parent, token) is not None:
            raise ValueError(f"node {parent} already has a child with token {token}")
        i = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(self.depths[parent] + 1)
        self.proposals.append(proposal)
        self.values.append(float(value))
        self.kinds.append(kind)
        self.children.append([])
        self.children[parent].append(i)
        return i

    def child_with(self, node: int, token: int) -> int | None:
        for c in self.children[node]:
            if self.tokens[c] == token:
                return c
        return None

    def path_tokens(self, path: Sequence[int]) -> list[int]:
        return [self.tokens[i] for i in path]

    def pruned(self, keep: Sequence[int]) -> DraftTree:
        """The tree of the nodes `keep` (each one's parent kept too), in their order here."""
        keep = sorted(set(keep) | set(range(self.forced)))
        new_index = {old: new for new, old in enumerate(keep)}
        out = DraftTree.root(self.tokens[0])
        for old in keep[1:]:
            if self.parents[old] not in new_index:
                raise ValueError(f"node {old} is kept without its parent {self.parents[old]}")
            out.add(new_index[self.parents[old]], self.tokens[old], proposal=self.proposals[old],
                    value=self.values[old], kind=self.kinds[old])
        out.forced = self.forced
        return out


# ---------------------------------------------------------------- acceptance


def accept_tree_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """(accepted root-to-node path, next token): follow the target's argmax (logits [>= len(tree), V])."""
    argmax = logits[:len(tree)].argmax(-1).tolist()
    path = [0]
    while True:
        token = argmax[path[-1]]
        child = tree.child_with(path[-1], token)
        if child is None:
            return path, int(token)
        path.append(child)


def resolve_node(p: torch.Tensor, candidates: Sequence[tuple[int, torch.Tensor | None]],
                 generator: torch.Generator | None) -> tuple[int | None, int | None]:
    """The multi-candidate rule at one node (module docstring): p [V] the target's law, candidates
    (token, q) in order, q None for a point mass. Returns (index of the kept candidate, None) or (None,
    the token drawn from the final residual)."""
    for i, (x, q) in enumerate(candidates):
        u = float(torch.rand((), generator=generator, device=p.device))
        if q is None:
            if u < float(p[x]):
                return i, None
            residual = p.clone()
            residual[x] = 0.0
        else:
            if u * float(q[x]) < float(p[x]):  # u < p/q without dividing (q(x) > 0: x was drawn from q)
                return i, None
            residual = (p - q).clamp_min(0.0)
        mass = residual.sum()
        # no residual mass means the rejection had probability 0 (p == q, or p a point mass on x)
        if float(mass) > 0:
            p = residual / mass
    return None, int(sample_from(p, generator))


NodeRule = Callable[[torch.Tensor, Sequence[tuple[int, torch.Tensor | None]], torch.Generator | None],
                    tuple[int | None, int | None]]


def accept_tree_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None, *,
                         node_rule: NodeRule = resolve_node) -> tuple[list[int], int]:
    """(accepted root-to-node path, next token) by the multi-candidate rule at each node on the way down;
    probs [>= len(tree), V]: the target's (sampling-transformed) law after each node. `node_rule` is the
    seam the distribution test swaps wrong rules into."""
    path = [0]
    while True:
        node = path[-1]
        kids = tree.children[node]
        kept, drawn = node_rule(probs[node], [(tree.tokens[c], tree.proposals[c]) for c in kids], generator)
        if kept is None:
            return path, int(drawn)
        path.append(kids[kept])


# ---------------------------------------------------------------- drafter sources


@dataclass
class NodeDistribution:
    """A drafter's distribution for the children of one node: probs [n] at temperature 1 over `ids`
    (target ids), sorted descending (the candidates), and the confidence of the most likely one."""

    ids: list[int]
    probs: list[float]
    confidence: float


class _HSpecSource:
    """Per-node distributions of an H-Spec drafter from one backbone forward: slot j given the token at
    slot j - 1 is base[j] + the Markov bias of that token; the confidence head reads the same pair.

    Nodes are computed in batches (`prefetch_keys`): the heads of one slot for many previous tokens cost one
    small GEMM, about what one token costs, so expanding a node also expands the parent's other candidates
    (the tree's likely siblings) in the same call, and a tree costs about one head call per depth."""

    def __init__(self, model, ctx: DraftContext, *, confidence: Callable, top: int):
        self.model, self.confidence, self.top = model, confidence, top
        self.block_size = model.block_size
        n = ctx.last_position.to(model.d2t.device)
        with torch.no_grad():
            self.h = model.backbone(ctx.anchor_tokens, n, ctx.target_hidden, model.propose_contexts(ctx))
            self.base = model.base_logits(self.h)
        self.vocab = model.config.target.vocab_size
        self._nodes: dict[tuple[int, int, int], tuple[NodeDistribution, torch.Tensor]] = {}

    @torch.no_grad()
    def prefetch_keys(self, keys: Sequence[tuple[int, int, int]]) -> None:
        """Compute and keep the nodes (row, slot, prev) not yet computed, in one head call for all of them."""
        todo = [k for k in dict.fromkeys(keys) if k not in self._nodes]
        if not todo:
            return
        rows = torch.tensor([k[0] for k in todo], device=self.h.device)
        slots = torch.tensor([k[1] for k in todo], device=self.h.device)
        prev_t = torch.tensor([k[2] for k in todo], device=self.h.device)
        out = self.model.head_outputs(self.h[rows, slots], prev_t, self.base[rows, slots])
        probs = torch.softmax(out.logits.float(), -1)
        top_p, top_i = probs.topk(min(self.top, probs.shape[-1]), dim=-1)
        ids, top_p = self.model.d2t[top_i].tolist(), top_p.tolist()
        if out.confidence_logits is not None:
            confs = self.confidence.many([k[1] for k in todo], out.confidence_logits)
        else:
            confs = [row[0] for row in top_p]
        for i, key in enumerate(todo):
            self._nodes[key] = (NodeDistribution(ids[i], top_p[i], confs[i]), out.logits[i])

    def prefetch_greedy_chains(self, anchors: Sequence[int], max_depths: Sequence[int]) -> None:
        """Greedy: every row's drafter chain and the candidates beside it (its likely siblings), one head call
        per depth for all rows; the trees are then built mostly from these (the lookup's nodes and the
        siblings' own continuations are computed as they come)."""
        prevs = {b: [int(a)] for b, a in enumerate(anchors)}  # tokens at depth d whose children are wanted
        for d in range(self.block_size):
            rows = [b for b in prevs if d < max_depths[b]]
            if not rows:
                return
            self.prefetch_keys([(b, d, p) for b in rows for p in prevs[b]])
            nxt = {}
            for b in rows:
                dist, logits = self._nodes[(b, d, prevs[b][0])]
                main = int(self.model.d2t[logits.argmax()])  # the chain's token, as main_child takes it
                nxt[b] = [main] + [i for i in dist.ids if i != main]
            prevs = nxt

    def node(self, b: int, slot: int, prev: int, *, siblings: Sequence[int] = ()) -> tuple[NodeDistribution, torch.Tensor]:
        """The node (b, slot, prev); `siblings`: other previous tokens likely to be asked for at this slot
        next, computed in the same call when this one is not computed yet."""
        if (b, slot, prev) not in self._nodes:
            self.prefetch_keys([(b, slot, p) for p in (prev, *siblings)])
        return self._nodes[(b, slot, prev)]

    def main_child(self, b: int, slot: int, logits: torch.Tensor, sampling: SamplingParams,
                   generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
        if sampling.greedy:  # the argmax itself, as the chain's propose takes it
            return int(self.model.d2t[logits.argmax()]), None
        probs = sampling_probs(logits[None], sampling)[0]
        draft_tok = sample_from(probs, generator)
        q = torch.zeros(self.vocab, device=probs.device).scatter_(0, self.model.d2t, probs)
        return int(self.model.d2t[draft_tok]), q


class _BlockSource:
    """Any drafter through its proposal: the main branch is the proposed block; the distribution of a node's
    children is the block's q at that slot whatever the parent (the drafter conditions on nothing else)."""

    def __init__(self, proposal, *, confidence: Callable, top: int, block_size: int):
        self.proposal, self.confidence, self.top, self.block_size = proposal, confidence, top, block_size

    def node(self, b: int, slot: int, prev: int, *, siblings: Sequence[int] = ()) -> tuple[NodeDistribution, None]:
        q, conf = self.proposal.q, self.proposal.confidence_logits
        raw = None if conf is None else float(conf[b, slot])
        if q is None:
            return NodeDistribution([], [], float(self.confidence(slot, raw)) if raw is not None else 0.5), None
        top_p, top_i = q[b, slot].float().topk(min(self.top, q.shape[-1]))
        c = float(self.confidence(slot, raw)) if raw is not None else float(top_p[0])
        return NodeDistribution(top_i.tolist(), top_p.tolist(), c), None

    def main_child(self, b: int, slot: int, logits, sampling: SamplingParams,
                   generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
        q = self.proposal.q
        return int(self.proposal.tokens[b, slot]), (None if q is None or sampling.greedy else q[b, slot].float())

    def main_length(self, b: int) -> int:
        lengths = self.proposal.lengths
        return self.block_size if lengths is None else int(lengths[b])


class SlotConfidence:
    """(slot, raw confidence logit) -> probability through a per-slot transform of [B, block_size] logits
    (sigmoid, or STS's per-slot temperatures); `many` maps many (slot, logit) pairs in one call."""

    def __init__(self, transform: Callable[[torch.Tensor], torch.Tensor], block_size: int):
        self.transform, self.block_size = transform, block_size

    def many(self, slots: Sequence[int], logits: torch.Tensor) -> list[float]:
        """The probabilities of logits [n], entry i read at slot slots[i]."""
        n = logits.numel()
        cols = torch.tensor(list(slots), dtype=torch.long)
        rows = torch.zeros((n, self.block_size))
        rows[torch.arange(n), cols] = logits.reshape(-1).float().cpu()
        return self.transform(rows)[torch.arange(n), cols].tolist()

    def __call__(self, slot: int, logit: float) -> float:
        return self.many([slot], torch.tensor([logit]))[0]


# ---------------------------------------------------------------- building


def build_tree(source, b: int, *, anchor: int, sampling: SamplingParams, generator: torch.Generator | None,
               spec: TreeSpec, max_depth: int, lookup: Sequence[int] = ()) -> DraftTree:
    """Row b's tree (module docstring): the main branch, then best first among siblings, their
    continuations and the lookup branch, up to spec.max_rows nodes and depth max_depth (<= block_size)."""
    tree = DraftTree.root(anchor)
    heap: list = []
    order = itertools.count()
    dists: dict[int, NodeDistribution] = {}
    next_rank: dict[int, int] = {}
    max_depth = min(max_depth, source.block_size)
    main_len = source.main_length(b) if hasattr(source, "main_length") else source.block_size

    def expand(u: int):
        if tree.depths[u] >= max_depth:
            return None
        parent = tree.parents[u]
        siblings = dists[parent].ids if parent in dists else ()  # the parent's other candidates, likely next
        dist, logits = source.node(b, tree.depths[u], tree.tokens[u], siblings=siblings)
        dists[u], next_rank[u] = dist, 0
        return logits

    def push_sibling(u: int) -> None:
        """u's best not-yet-taken candidate, valued (module docstring)."""
        dist = dists.get(u)
        if dist is None or len(tree.children[u]) >= spec.max_children:
            return
        taken = {tree.tokens[c] for c in tree.children[u]}
        r = next_rank[u]
        while r < len(dist.ids) and dist.ids[r] in taken:
            r += 1
        next_rank[u] = r + 1
        if r >= len(dist.ids):
            return
        if r == 0:
            cond = dist.confidence
        else:
            cond = (1.0 - dist.confidence) * dist.probs[r] / max(1.0 - dist.probs[0], 1e-6)
        heapq.heappush(heap, (-tree.values[u] * min(cond, 1.0), next(order), "sibling", u, dist.ids[r], None))

    def push_lookup(u: int, i: int) -> None:
        if i >= len(lookup) or tree.depths[u] >= max_depth:
            return
        existing = tree.child_with(u, lookup[i])
        if existing is not None:  # merged: the lookup agrees with the tree here
            push_lookup(existing, i + 1)
            return
        beside = (1.0 - dists[u].confidence) if (u in dists and tree.children[u]) else 1.0
        heapq.heappush(heap, (-tree.values[u] * LOOKUP_CONFIDENCE * beside, next(order), "lookup", u, lookup[i], i))

    # the main branch, always in the tree: the drafter's chain, or where the lookup agrees with the drafter's
    # slot-1 token the splice's chain (slot 1, then the lookup), as the chain engine would verify it
    u, spliced = 0, False
    logits = expand(u)
    while u in dists and tree.depths[u] < (source.block_size if spliced else main_len) and len(tree) < spec.max_rows:
        d = tree.depths[u]
        if spliced:
            c = tree.add(u, lookup[d], proposal=None, value=tree.values[u] * LOOKUP_CONFIDENCE, kind="lookup")
        else:
            token, q = source.main_child(b, d, logits, sampling, generator)
            c = tree.add(u, token, proposal=q, value=tree.values[u] * dists[u].confidence, kind="main")
            spliced = d == 0 and len(lookup) == source.block_size and token == lookup[0]
        push_sibling(u)
        u = c
        logits = expand(u)
    tree.forced = len(tree)
    if not spliced:
        push_lookup(0, 0)
    while heap and len(tree) < spec.max_rows:
        neg, _, kind, parent, token, extra = heapq.heappop(heap)
        if -neg < spec.min_value:
            break
        existing = tree.child_with(parent, token)
        if kind == "lookup":
            if existing is None:
                existing = tree.add(parent, token, proposal=None, value=-neg, kind="lookup")
                expand(existing)
                push_lookup(existing, extra + 1)
                push_sibling(existing)
            else:
                push_lookup(existing, extra + 1)
            continue
        if existing is None and len(tree.children[parent]) < spec.max_children:
            c = tree.add(parent, token, proposal=None, value=-neg, kind="sibling")
            expand(c)
            push_sibling(c)
        push_sibling(parent)
    return tree


def lookup_of(drafter) -> PromptLookup | None:
    return drafter.lookup if isinstance(drafter, LookupSpliceDrafter) else None


def tree_drafter_core(drafter):
    """The drafter the tree reads: a LookupSpliceDrafter's inner drafter (the tree adds the lookup as a
    branch of its own). Drafters with a drafter-side KV cache are refused."""
    inner = drafter.drafter if isinstance(drafter, LookupSpliceDrafter) else drafter
    if getattr(inner, "extend_context", None) is not None:
        raise ValueError(f"tree verification needs a drafter without a drafter-side KV cache; {inner.name} has one "
                         "(use the chain engine, SpeculativeEngine)")
    return inner


def build_trees(drafter, ctx: DraftContext, sampling: SamplingParams, generator: torch.Generator | None, *,
                spec: TreeSpec, max_depths: Sequence[int],
                confidence_transform: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid) -> list[DraftTree]:
    """One drafter forward over the context's rows, one tree per row (row b at most max_depths[b] deep)."""
    core = tree_drafter_core(drafter)
    block_size = core.block_size
    conf = SlotConfidence(confidence_transform, block_size)
    top = spec.max_children + 1
    if all(hasattr(core, name) for name in ("backbone", "head_outputs", "propose_contexts", "d2t")):
        source = _HSpecSource(core, ctx, confidence=conf, top=top)
    else:
        source = _BlockSource(core.propose(ctx, sampling, generator), confidence=conf, top=top, block_size=block_size)
    lookup = lookup_of(drafter) if spec.lookup else None
    anchors = ctx.anchor_tokens.tolist()
    if sampling.greedy and isinstance(source, _HSpecSource):
        source.prefetch_greedy_chains(anchors, [min(int(d), block_size) for d in max_depths])
    trees = []
    for b, anchor in enumerate(anchors):
        cont = lookup.continuation(list(ctx.token_history[b]) + [anchor]) if lookup is not None else []
        trees.append(build_tree(source, b, anchor=anchor, sampling=sampling, generator=generator, spec=spec,
                                max_depth=int(max_depths[b]), lookup=cont))
    return trees


def size_trees(trees: Sequence[DraftTree], sps) -> list[DraftTree]:
    """The trees cut to the nodes worth their verify rows (scheduler/planner.py `tree_extra_budget`): each
    tree's root and main branch stay; of the other nodes, the best by value across all requests, as many
    as maximise (expected tokens) / (step seconds: the verify's at the batch's rows on `sps`, an SpsCurve,
    plus the drafter's forward where the table has its column). A node's
    value never exceeds its parent's and ties go to the earlier node, so the kept nodes form trees. Only
    point-mass nodes are ever cut, so sampling stays exact (module docstring)."""
    from sglang_hspec.scheduler.planner import tree_extra_budget

    extras = [(-t.values[i], i, j) for j, t in enumerate(trees) for i in range(t.forced, len(t))]
    forced_tau = float(sum(sum(t.values[:t.forced]) for t in trees))  # the root's 1.0 is the bonus token
    forced_tokens = sum(t.forced for t in trees)
    draft = getattr(sps.table, "draft_lookup", None)  # the drafter's forward, paid whatever the rows
    n = tree_extra_budget(extra_values=torch.tensor([-v for v, _, _ in extras], dtype=torch.float64),
                          forced_tau=forced_tau, forced_tokens=forced_tokens, num_reqs=len(trees), sps=sps,
                          fixed_seconds=draft(len(trees)) if draft is not None else 0.0)
    keep: list[list[int]] = [[] for _ in trees]
    for _, i, j in sorted(extras)[:n]:
        keep[j].append(i)
    return [t.pruned(k) if len(k) + t.forced < len(t) else t for t, k in zip(trees, keep)]


# ---------------------------------------------------------------- verify and commit


@dataclass
class TreeStepOutput:
    paths: list[list[int]]  # accepted root-to-node path per row (node 0 = the anchor)
    accepted_tokens: list[list[int]]  # per row: the accepted draft tokens (the anchor not included)
    next_tokens: torch.Tensor  # [B] the next anchor per row
    last_hidden: torch.Tensor | None  # [B, n_ids, hidden] at each row's last accepted node


def verify_trees(adapter: TargetAdapter, trees: Sequence[DraftTree], *, rows: torch.Tensor, sampling: SamplingParams,
                 generator: torch.Generator | None, hidden_layer_ids=()) -> TreeStepOutput:
    """One target forward over every row's tree, the acceptance walk, and the commit of each accepted path."""
    device = adapter.device
    b = len(trees)
    m = max(len(t) for t in trees)
    tokens = torch.zeros((b, m), dtype=torch.long)
    parents = torch.full((b, m), -1, dtype=torch.long)
    for j, t in enumerate(trees):
        tokens[j, :len(t)] = torch.tensor(t.tokens)
        parents[j, :len(t)] = torch.tensor(t.parents)
    out = adapter.extend_tree(tokens, parents=parents, rows=rows, hidden_layer_ids=hidden_layer_ids)
    paths, next_tokens = [], []
    for j, t in enumerate(trees):
        if sampling.greedy:
            path, nxt = accept_tree_greedy(t, out.logits[j])
        else:
            path, nxt = accept_tree_sampling(t, sampling_probs(out.logits[j, :len(t)], sampling), generator)
        paths.append(path)
        next_tokens.append(nxt)
    width = max(len(p) for p in paths)
    path_t = torch.zeros((b, width), dtype=torch.long)
    for j, p in enumerate(paths):
        path_t[j, :len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in paths])
    adapter.commit_path(path_t, path_lengths=lengths, rows=rows)
    last_hidden = None
    if out.hidden is not None:
        last = torch.tensor([p[-1] for p in paths], device=device)
        last_hidden = out.hidden[torch.arange(b, device=device), last]
    return TreeStepOutput(paths=paths, accepted_tokens=[t.path_tokens(p[1:]) for t, p in zip(trees, paths)],
                          next_tokens=torch.tensor(next_tokens, device=device), last_hidden=last_hidden)


class TreeVerifier:
    """Draft a tree, verify it, commit the accepted path: the step a generate loop calls instead of
    draft / plan / verify / rollback."""

    def __init__(self, adapter: TargetAdapter, drafter, *, spec: TreeSpec = TreeSpec(),
                 confidence_transform: Callable[[torch.Tensor], torch.Tensor] | None = None, sps=None):
        """sps: an SpsCurve of the target's verify forwards (default: spec.sps_table's); given, each step's
        trees are cut to the nodes that raise expected tokens x steps/s (`size_trees`), else every tree
        fills spec.max_rows."""
        tree_drafter_core(drafter)
        adapter.check_layer_ids(list(drafter.target_layer_ids) + list(drafter.kv_layer_ids))
        if sps is None and spec.sps_table is not None:
            from sglang_hspec.scheduler.sps import SpsCurve, load_sps_table

            sps = SpsCurve(load_sps_table(spec.sps_table))
        self.adapter, self.drafter, self.spec, self.sps = adapter, drafter, spec, sps
        self.confidence_transform = confidence_transform or torch.sigmoid

    def step(self, ctx: DraftContext, sampling: SamplingParams, generator: torch.Generator | None, *,
             rows: torch.Tensor, max_depths: Sequence[int]) -> tuple[list[DraftTree], TreeStepOutput]:
        trees = build_trees(self.drafter, ctx, sampling, generator, spec=self.spec, max_depths=max_depths,
                            confidence_transform=self.confidence_transform)
        if self.sps is not None:
            trees = size_trees(trees, self.sps)
        out = verify_trees(self.adapter, trees, rows=rows, sampling=sampling, generator=generator,
                           hidden_layer_ids=list(self.drafter.target_layer_ids))
        return trees, out
