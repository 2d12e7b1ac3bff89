"""The zero-bubble schedules ZB-H1 and ZB-V, DualPipeV and LoopedBFS: each device's order against an order
written out independently here (by hand for the small sizes, by a second rule for the others),
W after its B and before the flush, and their bubbles and activation memory beside 1F1B's,
GPipe's and interleaved 1F1B's, by the formulas of their papers."""
import collections

import pytest

from cdpjax.errors import ConfigError
from cdpjax.layouts.looped_bfs import looped_bfs_order
from cdpjax.layouts.zb_h1 import zb_h1_order
from cdpjax.layouts.zbv import zbv_order
from cdpjax.timetable import table

SIZES = [(K, M) for K in (2, 4) for M in (4, 8)]


def device_orders(t, step=0):
    """Each device's (kind, stage, micro-batch) in the order its ticks run them."""
    ops = sorted((o for o in t.ops if o.step == step), key=lambda o: (o.device, o.tick))
    orders = collections.defaultdict(list)
    for o in ops:
        orders[o.device].append((o.kind, o.stage, o.micro))
    return [orders[d] for d in range(t.devices)]


def numbered(device_kinds):
    """A sequence of (kind, stage) with each pair's micro-batches counted 0, 1, 2, ... in order."""
    seen = collections.Counter()
    out = []
    for kind, stage in device_kinds:
        out.append((kind, stage, seen[kind, stage]))
        seen[kind, stage] += 1
    return out


def parse(text):
    """'F0.1 B0.0 ...' (kind, stage.micro-batch) as actions."""
    return [(tok[0], int(tok[1:].split(".")[0]), int(tok.split(".")[1])) for tok in text.split()]


# ------------------------------------------------------------------------ ZB-H1


def zb_h1_rule(j, K, M):
    """ZB-H1 by a second rule: 1F1B's kinds on device j (min(K-1-j, M) forwards, then F B pairs,
    then the remaining Bs), micro-batches counted per kind, and the W of micro-batch m right after
    the B of micro-batch m + j; the Ws left over close the list."""
    w = min(K - 1 - j, M)
    ofob = numbered([("F", j)] * w + [("F", j), ("B", j)] * (M - w) + [("B", j)] * w)
    out = []
    for action in ofob:
        out.append(action)
        if action[0] == "B" and action[2] - j >= 0:
            out.append(("W", j, action[2] - j))
    return out + [("W", j, m) for m in range(max(M - j, 0), M)]


ZB_H1_BY_HAND = {  # written out from ZB-H1's description (Qi et al. 2023, figure 3; torch's ZB1P, V = 1)
    (2, 4): ["F0.0 F0.1 B0.0 W0.0 F0.2 B0.1 W0.1 F0.3 B0.2 W0.2 B0.3 W0.3",
             "F1.0 B1.0 F1.1 B1.1 W1.0 F1.2 B1.2 W1.1 F1.3 B1.3 W1.2 W1.3"],
    (4, 4): ["F0.0 F0.1 F0.2 F0.3 B0.0 W0.0 B0.1 W0.1 B0.2 W0.2 B0.3 W0.3",
             "F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 W1.0 B1.2 W1.1 B1.3 W1.2 W1.3",
             "F2.0 F2.1 B2.0 F2.2 B2.1 F2.3 B2.2 W2.0 B2.3 W2.1 W2.2 W2.3",
             "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 W3.0 W3.1 W3.2 W3.3"],
}


@pytest.mark.parametrize("K,M", SIZES)
def test_zb_h1_orders(K, M):
    t = table("zb-h1", stages=K, microbatches=M, steps=1)
    expected = [zb_h1_rule(j, K, M) for j in range(K)]
    assert device_orders(t) == expected == [zb_h1_order(j, K, M) for j in range(K)]
    if (K, M) in ZB_H1_BY_HAND:
        assert expected == [parse(row) for row in ZB_H1_BY_HAND[K, M]]


# ------------------------------------------------------------------------- ZB-V


def zbv_rule(r, D, M):
    """ZB-V's kinds on device r by their counts (n = max(2D-1, M) micro-batches laid out, chunk 0
    = stage r going down, chunk 1 = stage 2D-1-r coming back): 2D-1-r forwards of chunk 0 in all
    before chunk 1's F/B/W warm-up completes, i.e. 2(D-r)-1 of them, r (F1, F0) pairs and D-r
    (F1, B1, W1) triples; n-D steady rounds (F0 in the first n-2D+r+1 of them), B0 W0 F1 B1 W1;
    r (B0, B1) pairs, D-r (B0, W0) pairs; then the r W1s and r W0s still owed. Ops of micro-batches
    M and above dropped."""
    n = max(2 * D - 1, M)
    down, up = ("F", r), ("F", 2 * D - 1 - r)
    B0, W0, B1, W1 = ("B", r), ("W", r), ("B", 2 * D - 1 - r), ("W", 2 * D - 1 - r)
    kinds = [down] * (2 * (D - r) - 1) + [up, down] * r + [up, B1, W1] * (D - r)
    for i in range(n - D):
        kinds += ([down] if i < n - 2 * D + r + 1 else []) + [B0, W0, up, B1, W1]
    kinds += [B0, B1] * r + [B0, W0] * (D - r) + [W1] * r + [W0] * r
    return [a for a in numbered(kinds) if a[2] < M]


ZBV_BY_HAND = {  # D = 2 (stages 0 and 3 on device 0, 1 and 2 on device 1), M = 4, from torch's ZBV
    (2, 4): ["F0.0 F0.1 F0.2 F3.0 B3.0 W3.0 F3.1 B3.1 W3.1 F0.3 B0.0 W0.0 F3.2 B3.2 W3.2 B0.1 W0.1 F3.3 B3.3 "
             "W3.3 B0.2 W0.2 B0.3 W0.3",
             "F1.0 F2.0 F1.1 F2.1 B2.0 W2.0 F1.2 B1.0 W1.0 F2.2 B2.1 W2.1 F1.3 B1.1 W1.1 F2.3 B2.2 W2.2 B1.2 "
             "B2.3 B1.3 W1.2 W2.3 W1.3"],
}


@pytest.mark.parametrize("D", [1, 2, 4])
@pytest.mark.parametrize("M", [4, 8])
def test_zbv_orders(D, M):
    """D devices, 2D stages in the V placement (device r: stages r and 2D-1-r); K = 2D in {2, 4, 8}."""
    t = table("zbv", stages=2 * D, microbatches=M, steps=1)
    expected = [zbv_rule(r, D, M) for r in range(D)]
    assert device_orders(t) == expected == [zbv_order(r, D, M) for r in range(D)]
    assert {o.stage: o.device for o in t.ops} == {s: min(s, 2 * D - 1 - s) for s in range(2 * D)}
    if (D, M) in ZBV_BY_HAND:
        assert expected == [parse(row) for row in ZBV_BY_HAND[D, M]]


# ------------------------------------------------------------------- LoopedBFS


def looped_bfs_rule(d, D, V, M):
    """LoopedBFS as a sort: device d's forwards before its backwards; forwards by (stage, micro-batch),
    backwards by (stage, micro-batch) both descending."""
    ops = [(k, c * D + d, m) for k in "FB" for c in range(V) for m in range(M)]
    return sorted(ops, key=lambda a: (a[0] == "B", (a[1], a[2]) if a[0] == "F" else (-a[1], -a[2])))


LOOPED_BFS_BY_HAND = {  # D = 2, V = 2 (stages 0, 2 on device 0; 1, 3 on device 1), M = 4
    (2, 2, 4): ["F0.0 F0.1 F0.2 F0.3 F2.0 F2.1 F2.2 F2.3 B2.3 B2.2 B2.1 B2.0 B0.3 B0.2 B0.1 B0.0",
                "F1.0 F1.1 F1.2 F1.3 F3.0 F3.1 F3.2 F3.3 B3.3 B3.2 B3.1 B3.0 B1.3 B1.2 B1.1 B1.0"],
}


@pytest.mark.parametrize("D,M", SIZES)
@pytest.mark.parametrize("V", [2, 3])
def test_looped_bfs_orders(D, M, V):
    t = table("looped-bfs", stages=V * D, chunks=V, microbatches=M, steps=1)
    expected = [looped_bfs_rule(d, D, V, M) for d in range(D)]
    assert device_orders(t) == expected == [looped_bfs_order(d, D, V, M) for d in range(D)]
    assert {o.stage: o.device for o in t.ops} == {s: s % D for s in range(V * D)}
    if (D, V, M) in LOOPED_BFS_BY_HAND:
        assert expected == [parse(row) for row in LOOPED_BFS_BY_HAND[D, V, M]]


# -------------------------------------------------------------------- DualPipeV


# torch.distributed.pipelining's ScheduleDualPipeV, each rank's actions written out by hand from its
# eight steps (rank r: stage r down, 2D-1-r up), in torch's words: F forward, I input backward,
# W weight backward (the oldest owed), B a whole backward, "F+B" an overlapped forward and backward
# of other micro-batches; "<stage>.<micro-batch>".
DUALPIPEV_BY_TORCH = {
    (2, 4): ["F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 F0.3+B3.1 F3.2+B0.0 B3.2 F3.3+B0.1 B3.3 I0.2 W0.2 I0.3 W0.3",
             "F1.0 F2.0 F1.1 F2.1 F1.2 B2.0 F2.2+B1.0 F1.3+B2.1 F2.3+B1.1 B2.2 B1.2 I2.3 I1.3 W2.3 W1.3"],
    (3, 6): ["F0.0 F0.1 F0.2 F0.3 F0.4 F5.0 I5.0 W5.0 F5.1 I5.1 W5.1 F5.2 F0.5+B5.2 F5.3+B0.0 B5.3 F5.4+B0.1 "
             "B5.4 F5.5+B0.2 B5.5 I0.3 W0.3 I0.4 W0.4 I0.5 W0.5",
             "F1.0 F1.1 F1.2 F4.0 F1.3 F4.1 I4.0 W4.0 F4.2 F1.4+B4.1 F4.3+B1.0 F1.5+B4.2 F4.4+B1.1 B4.3 F4.5+B1.2 "
             "B4.4 B1.3 I4.5 I1.4 W4.5 I1.5 W1.4 W1.5",
             "F2.0 F3.0 F2.1 F3.1 F2.2 F3.2 F2.3 B3.0 F3.3+B2.0 F2.4+B3.1 F3.4+B2.1 F2.5+B3.2 F3.5+B2.2 B3.3 B2.3 "
             "B3.4 I2.4 I3.5 I2.5 W2.4 W3.5 W2.5"],
}


def in_torch_words(t, step=0):
    """Each device's ticks as torch's actions: a lone F, B or W is F, I (the input half) or W; a B and
    W of one stage and micro-batch in one tick a whole backward B; beside a forward, an overlap F+B."""
    cells = collections.defaultdict(list)
    for o in t.ops:
        if o.step == step:
            cells[o.device, o.tick].append(o)
    rows = [[] for _ in range(t.devices)]
    for (d, _), ops in sorted(cells.items()):
        forward = [f"F{o.stage}.{o.micro}" for o in ops if o.kind == "F"]
        halves = {(o.stage, o.micro): {p.kind for p in ops if (p.stage, p.micro) == (o.stage, o.micro)}
                  for o in ops if o.kind != "F"}
        backward = [({"B": "I", "W": "W"}[next(iter(k))] if len(k) == 1 else "B") + f"{j}.{m}"
                    for (j, m), k in halves.items()]
        assert len(forward) + len(backward) <= 2 and all(k <= {"B", "W"} for k in halves.values()), ops
        rows[d].append("+".join(forward + backward))
    return rows


@pytest.mark.parametrize("D,M", list(DUALPIPEV_BY_TORCH))
def test_dualpipev_is_torchs_order(D, M):
    """Each device's ticks, in order, are torch's DualPipeV actions for its rank, overlapped pairs in one tick."""
    t = table("dualpipev", stages=2 * D, microbatches=M, steps=1)
    assert in_torch_words(t) == [row.split() for row in DUALPIPEV_BY_TORCH[D, M]]
    assert {o.stage: o.device for o in t.ops} == {s: min(s, 2 * D - 1 - s) for s in range(2 * D)}
    assert any("+" in cell for cell in t.grid().ravel())  # the grid shows the overlapped ticks


def test_dualpipev_needs_a_micro_batch_per_stage():
    with pytest.raises(ConfigError, match=r"microbatches=3 with stages=4 \(give microbatches >= 4\)"):
        table("dualpipev", stages=4, microbatches=3)


# ------------------------------------------------------- W after B, before the flush


@pytest.mark.parametrize("name,sizes", [("zb-h1", dict(stages=4)), ("zbv", dict(stages=8)),
                                        ("zb-h1", dict(stages=2)), ("zbv", dict(stages=4))])
@pytest.mark.parametrize("M", [4, 8])
def test_w_after_its_b_and_before_the_flush(name, sizes, M):
    """Every stage, micro-batch and step has one F, one B and one W; the W runs after its B, on the
    same device, and no later than the tick at whose end its stage updates."""
    t = table(name, microbatches=M, steps=2, **sizes)
    ticks = collections.defaultdict(list)
    for o in t.ops:
        ticks[(o.kind, o.stage, o.micro, o.step)].append((o.tick, o.device))
    update = {(u.stage, u.step): u.tick for u in t.updates}
    for j in range(t.stages):
        for m in range(M):
            for k in range(2):
                (f, _), (b, b_dev), (w, w_dev) = (ticks[(kind, j, m, k)][0] for kind in "FBW")
                assert all(len(ticks[(kind, j, m, k)]) == 1 for kind in "FBW")
                assert f < b < w <= update[(j, k)] and b_dev == w_dev
    assert t.split_backward


# ------------------------------------------------------- bubbles and memory


def idle_ticks(t):
    """Idle ticks of each device over one step (the flushed layouts' steady window is a step)."""
    lo, hi = t.steady
    busy = collections.Counter(o.device for o in t.ops if lo <= o.tick < hi)
    return [(hi - lo) - busy[d] for d in range(t.devices)]


def peak_bytes(t, stage_bytes):
    return t.activation_stats([stage_bytes] * t.stages)["device_peak_bytes"]


@pytest.mark.parametrize("K,M", SIZES)
def test_bubbles_and_activation_memory(K, M):
    """With every op one tick (F = B = W), on K devices, over one step:
    - 1F1B idles 2(K-1) ticks a device (of 2(M+K-1)); ZB-H1, whose W fills part of it, K-1 (of
      3M+K-1): its bubble is half 1F1B's in ticks, a third of it in time (1F1B's B is B + W), at
      the same largest activation memory, K stage-activations on the first device (ZB-H1 holds K
      on every device, the later ones keeping what their deferred Ws need);
    - ZB-V on the same K devices, its 2K stages half as deep, idles K-1 of its half-size ticks (of
      6M+K-1) where M >= 2K-1, and a device holds 2K half-size stage-activations: in bytes the
      activation memory of 1F1B's first device, for a quarter of 1F1B's bubble in time;
    - LoopedBFS with V = 2 stages per device idles 2(K-1) ticks of its half-size stages, the same
      as interleaved 1F1B (where interleaved can run M), at GPipe's activation memory in bytes
      (all V x M of its stage-activations at the turn) where interleaved 1F1B holds fewer."""
    ofob, zb = table("1f1b", stages=K, microbatches=M), table("zb-h1", stages=K, microbatches=M)
    zbv, bfs = table("zbv", stages=2 * K, microbatches=M), table("looped-bfs", stages=2 * K, chunks=2, microbatches=M)
    gpipe = table("gpipe", stages=K, microbatches=M)
    assert idle_ticks(ofob) == [2 * (K - 1)] * K and ofob.period == 2 * (M + K - 1)
    assert idle_ticks(zb) == [K - 1] * K and zb.period == 3 * M + K - 1
    assert zb.busy_fraction()["devices"] > ofob.busy_fraction()["devices"]
    assert peak_bytes(zb, 1.0) == peak_bytes(ofob, 1.0) == K  # the largest device's, in full stages
    assert [int(x) for x in zb.activation_per_worker()[: zb.period].max(0)] == [K] * K
    assert [int(x) for x in ofob.activation_per_worker()[: ofob.period].max(0)] == [K - j for j in range(K)]
    if M >= 2 * K - 1:
        assert idle_ticks(zbv) == [K - 1] * K and zbv.period == 6 * M + K - 1
    assert zbv.busy_fraction()["devices"] >= zb.busy_fraction()["devices"]
    assert peak_bytes(zbv, 0.5) == peak_bytes(ofob, 1.0)  # 2K half-size stages = K full ones
    assert idle_ticks(bfs) == [2 * (K - 1)] * K and bfs.period == 4 * M + 2 * (K - 1)
    assert peak_bytes(bfs, 0.5) == peak_bytes(gpipe, 1.0) == M
    if M % K == 0:
        inter = table("interleaved-1f1b", stages=2 * K, chunks=2, microbatches=M)
        assert bfs.busy_fraction()["devices"] == inter.busy_fraction()["devices"]
        assert peak_bytes(inter, 0.5) <= peak_bytes(bfs, 0.5)


@pytest.mark.parametrize("K,M", SIZES)
def test_lockstep_time_with_the_backward_split(K, M):
    """Replayed in lockstep with F = 1, the whole backward 2 and its weight half 1: 1F1B's ticks
    that hold a backward last 2; ZB-H1's ticks all last 1, so its step is its 3M + K - 1 ticks,
    below 1F1B's, and ZB-V's half-depth ops (half the costs) take (6M + K - 1) / 2 where M >= 2K-1."""
    from cdpjax import speedup

    costs = speedup.uniform_costs({"F": 1, "B": 2, "W": 1}, K)
    half = speedup.uniform_costs({"F": 0.5, "B": 1, "W": 0.5}, 2 * K)
    ofob = speedup.simulate(table("1f1b", stages=K, microbatches=M), costs, 1e15)["step_seconds"]
    zb = speedup.simulate(table("zb-h1", stages=K, microbatches=M), costs, 1e15)["step_seconds"]
    zbv = speedup.simulate(table("zbv", stages=2 * K, microbatches=M), half, 1e15)["step_seconds"]
    assert zb == pytest.approx(3 * M + K - 1) and zb < ofob
    if M >= 2 * K - 1:
        assert zbv == pytest.approx((6 * M + K - 1) / 2) and zbv < zb
