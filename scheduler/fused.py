"""AutoPolicy's per-step host work as a few compiled passes (numba), one call each.

The decision runs every step on the host. As ~50 numpy calls it cost 250-500 us at 256 requests on a
2-core EPYC, almost all of it per-call overhead (1-3 us per numpy call, ~9 us per torch op), not
arithmetic over 256 x 7 numbers. Each pass below does its part of the step in one call, and is the
compiled twin of the torch function that states its rule (scheduler/switch.py, scheduler/planner.py):

- `survival_pass` (`switch.estimated_survival`: the stale survival estimates, audit-corrected, unknown
  rows filled with the known rows' mean or with the prior) + numpy's sort + `best_rate_pass`
  (`switch.best_speculation`: tau(n) over them in descending order and the rate argmax); the decision
  itself is `switch.decision_from_best`, shared;
- `mature_pass`: a draft snapshot that has aged `lag` steps folded into each request's shrunk mean
  survival and the running prior (AutoPolicy's own state);
- `plan_pass`: the [block_size, B] float64 host copy of this step's confidences (checked to be
  probabilities), their corrected survivals and the top-`budget` lengths in the shared candidate order
  (`planner.topk_lengths` over `switch.estimated_survival` of every row);
- `audit_pass` (`switch.audit_counts`) / `fold_audit`: the acceptance audit's counts of one verified
  step, and the running counts and ratios once they mature.

Every sum runs in the order its torch twin's does (tests/scheduler/test_fused.py holds each pass to its
twin, to the bit, on random inputs). `cache=True` keeps the compiled code beside this file, so only the
first process on a machine compiles (5-15 s on 2 cores; later imports load it in well under a second);
`warm_up()`, which AutoPolicy calls when it is built, compiles or loads them ahead of the first step.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def survival_pass(conf, gen, slots, gens, ratios, prior, use_prior, min_survival, scratch):
    """(num_known, known_rows, count): the N = len(slots) requests' estimated survivals that are
    >= min_survival, in scratch[:count] (any order).

    conf [block_size, S] float64: each slot's estimated confidences (mature_pass); gen [S] int64: their
    generation; slots / gens [N] int64: this step's requests; ratios [block_size]: the audit's rho_j;
    prior [block_size]: the running mean used when no request is known (use_prior); scratch
    [>= N block_size] float64. Known rows:
    cumprod(clip(c_j rho_j, 0, 1)); unknown rows: the known rows' mean of clip(c_j rho_j, 0, 1) (the
    prior's, when none is known). known_rows = how many rows the estimates rest on (0: nothing known,
    count 0)."""
    block_size = conf.shape[0]
    n = slots.shape[0]
    num_known = 0
    for i in range(n):
        if gen[slots[i]] == gens[i]:
            num_known += 1
    if n == 0 or block_size == 0:
        return num_known, 0, 0
    fill = np.empty(block_size)
    from_prior = num_known == 0 and use_prior
    if from_prior:
        for j in range(block_size):
            fill[j] = min(max(prior[j] * ratios[j], 0.0), 1.0)
    elif num_known == 0:
        return 0, 0, 0
    elif num_known < n:
        for j in range(block_size):
            acc = 0.0
            for i in range(n):
                if gen[slots[i]] == gens[i]:
                    acc += min(max(conf[j, slots[i]] * ratios[j], 0.0), 1.0)
            fill[j] = acc / num_known
    count = 0
    for i in range(n):
        own = not from_prior and gen[slots[i]] == gens[i]
        surv = 1.0
        for j in range(block_size):
            c = min(max(conf[j, slots[i]] * ratios[j], 0.0), 1.0) if own else fill[j]
            surv = surv * c if j else c
            if surv >= min_survival:  # NaN fails too
                scratch[count] = surv
                count += 1
    return num_known, (n if from_prior else num_known), count


@numba.njit(cache=True, nogil=True)
def best_rate_pass(ascending, num_reqs, verify_seconds, draft_seconds):
    """(best_n, best_rate): the first n maximising (N + a_1 + ... + a_n) / (draft + verify(N + n))
    over the survivals sorted descending (given ascending: numpy's sort is several times faster than
    a compiled one), tau summed left to right as the reference does. verify_seconds[b]: the seconds
    of a verify of b batch tokens (inf past capacity)."""
    count = ascending.shape[0]
    tau = float(num_reqs)
    best_n, best_rate = 0, tau / (draft_seconds + verify_seconds[num_reqs])
    for m in range(1, count + 1):
        tau += ascending[count - m]
        rate = tau / (draft_seconds + verify_seconds[num_reqs + m])
        if rate > best_rate:
            best_n, best_rate = m, rate
    return best_n, best_rate


def best_speculation(conf, gen, slots, gens, ratios, prior, use_prior, verify_seconds, draft_seconds, min_survival,
                     scratch) -> tuple[int, int, int, float]:
    """(num_known, known_rows, best_n, best_rate) of the switch for this step's requests: survival_pass,
    numpy's sort, best_rate_pass (arguments as theirs; verify_seconds at least N (block_size + 1) + 1
    long)."""
    num_known, known_rows, count = survival_pass(conf, gen, slots, gens, ratios, prior, use_prior, min_survival,
                                                 scratch)
    if known_rows == 0:
        return num_known, 0, 0, 0.0
    best_n, best_rate = best_rate_pass(np.sort(scratch[:count]), slots.shape[0], verify_seconds, draft_seconds)
    return num_known, known_rows, best_n, best_rate


@numba.njit(cache=True, nogil=True)
def mature_pass(conf, gen, surv_sum, count, prior_surv, prior, slots, gens, matured, has_prior, strength):
    """Folds one matured draft snapshot (matured [block_size, R] conditional confidences for slots / gens [R])
    into the host state, in survival space. Per request (a slot whose generation changes starts afresh):
    surv_sum [block_size, S] += its survivals cumprod(c), count [S] += 1. The population prior_surv
    [block_size]: 0.9 old + 0.1 this snapshot's mean survival (the mean itself when not has_prior). Then a
    request's estimate is the shrunk mean S = (strength x prior_surv + surv_sum) / (strength + count), written
    to conf [block_size, S] as conditionals S_j / S_{j-1} (S_{-1} = 1; 0 past a zero survival), and prior
    [block_size] gets prior_surv's conditionals likewise.

    Why a mean and why survivals: a request's confidences from two steps back predict this step's acceptance
    no better than the population does (docs/scheduler.md, "Estimates, two steps stale"), so one low snapshot
    must not hold a request plain; and a mean of conditionals under-predicts the mean survival where the
    confidences vary together (lookup-spliced blocks: 0.70 for 0.85). False when the snapshot is empty."""
    block_size, rows = matured.shape
    if rows == 0:
        return False
    mean = np.zeros(block_size)
    for r in range(rows):
        s = slots[r]
        if gen[s] != gens[r]:
            gen[s] = gens[r]
            count[s] = 0
            for j in range(block_size):
                surv_sum[j, s] = 0.0
        surv = 1.0
        for j in range(block_size):
            surv = surv * matured[j, r] if j else matured[j, r]
            surv_sum[j, s] += surv
            mean[j] += surv
        count[s] += 1
    for j in range(block_size):
        m = mean[j] * (1.0 / rows)
        prior_surv[j] = 0.9 * prior_surv[j] + 0.1 * m if has_prior else m
    previous = 1.0
    for j in range(block_size):
        prior[j] = prior_surv[j] / previous if previous > 0.0 else 0.0
        previous = prior_surv[j]
    for r in range(rows):
        s = slots[r]
        previous = 1.0
        for j in range(block_size):
            est = (strength * prior_surv[j] + surv_sum[j, s]) / (strength + count[s])
            conf[j, s] = est / previous if previous > 0.0 else 0.0
            previous = est
    return True


@numba.njit(cache=True, nogil=True)
def plan_pass(confidences, ratios, budget, conf_out, lengths, slots, drafted_at, step):
    """Fills conf_out [block_size, B] float64 with confidences [B, block_size] transposed and lengths
    [B] int64 with the top-`budget` verify lengths of the survivals cumprod(min(c_j rho_j, 1)) in the
    shared order (higher survival, then earlier slot, then lower request), and sets drafted_at[slots] =
    step. Returns the total of the verify lengths, or -1 (drafted_at untouched) when a confidence is
    outside [0, 1] or NaN."""
    b, block_size = confidences.shape
    for r in range(b):
        for j in range(block_size):
            c = float(confidences[r, j])
            if not (c >= 0.0 and c <= 1.0):
                return -1
            conf_out[j, r] = c
    for r in range(b):
        drafted_at[slots[r]] = step
    lengths[:] = 0
    total = b * block_size
    if budget <= 0 or total == 0:
        return 0
    if budget >= total:
        lengths[:] = block_size
        return total
    flat = np.empty(total)  # slot-major: m = j * B + r
    for r in range(b):
        surv = 1.0
        for j in range(block_size):
            c = min(conf_out[j, r] * ratios[j], 1.0)
            surv = surv * c if j else c
            flat[j * b + r] = surv
    threshold = np.partition(flat.copy(), total - budget)[total - budget]
    above = 0
    for j in range(block_size):
        for r in range(b):
            if flat[j * b + r] > threshold:
                lengths[r] += 1
                above += 1
    ties = budget - above  # the first ones at the threshold in the shared order (m = j * B + r ascending)
    for j in range(block_size):
        for r in range(b):
            if ties > 0 and flat[j * b + r] == threshold:
                lengths[r] += 1
                ties -= 1
    return budget


@numba.njit(cache=True, nogil=True)
def fold_audit(accepted, predicted, step_accepted, step_predicted, decay, prior, ratios):
    """The audit's running counts after one more matured step, in place: accepted = decay accepted +
    step_accepted (predicted likewise), ratios[j] = (accepted[j] + prior x rho_{j-1}) / (predicted[j] +
    prior) with rho_{-1} = 1: a slot shrinks toward the slot before it (a slot seldom verified inherits
    its predecessor's correction instead of claiming 1)."""
    previous = 1.0
    for j in range(accepted.shape[0]):
        accepted[j] = accepted[j] * decay + step_accepted[j]
        predicted[j] = predicted[j] * decay + step_predicted[j]
        ratios[j] = (accepted[j] + prior * previous) / (predicted[j] + prior)
        previous = ratios[j]


@numba.njit(cache=True, nogil=True)
def index_bounds(ids):
    """(min, max) of a non-empty int64 array in one pass."""
    low = high = ids[0]
    for i in range(1, ids.shape[0]):
        v = ids[i]
        if v < low:
            low = v
        elif v > high:
            high = v
    return low, high


@numba.njit(cache=True, nogil=True)
def audit_pass(conf, verify_lengths, num_accepted, accepted, predicted):
    """Fills accepted / predicted [block_size] with one verified step's counts (conf [block_size, B]
    float64): slot j of row r counts when j < min(verify_length, num_accepted + 1); accepted adds 1 if
    it was kept, predicted adds c_{r,j}."""
    block_size, b = conf.shape
    accepted[:] = 0.0
    predicted[:] = 0.0
    for r in range(b):
        limit = min(verify_lengths[r], num_accepted[r] + 1, block_size)
        for j in range(limit):
            if j < num_accepted[r]:
                accepted[j] += 1.0
            predicted[j] += conf[j, r]


def warm_up() -> None:
    """Compile (or load) the passes with the argument types AutoPolicy passes."""
    conf, gen = np.full((2, 4), 0.5), np.zeros(4, dtype=np.int64)
    ids = np.arange(2, dtype=np.int64)
    ratios = np.ones(2)
    survival_pass(conf, gen, ids, ids, ratios, ratios, False, 0.0, np.empty(8))
    best_rate_pass(np.full(4, 0.5), 2, np.ones(16), 0.0)
    mature_pass(conf, gen, np.zeros((2, 4)), np.zeros(4, dtype=np.int64), np.ones(2), np.ones(2), ids, ids,
                conf[:, :2].copy(), False, 8.0)
    for dtype in (np.float32, np.float64):
        plan_pass(np.full((2, 2), 0.5, dtype=dtype), ratios, 1, np.empty((2, 2)), np.empty(2, dtype=np.int64),
                  ids, np.zeros(4, dtype=np.int64), 0)
    audit_pass(conf[:, :2], ids, ids, np.empty(2), np.empty(2))
    fold_audit(np.zeros(2), np.zeros(2), np.ones(2), np.ones(2), 0.5, 1.0, np.ones(2))
    index_bounds(ids)
