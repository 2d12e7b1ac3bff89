"""cdp-zero: CDP's ops with each stage's parameters and optimizer state kept by one worker and
brought point to point to each op just before it runs (pure Python: the plan and its table).

The plan (`zero_plan`) of a cyclic table (cdp-v1 or cdp-v2, whole or split backwards):

- **Owners.** Stage j is kept by one worker, `owners[j]` (its parameters, the
  previous version where some op reads it, and its optimizer state): with N >= L
  workers every stage has its own owner; with fewer, each worker owns at most
  ceil(L/N) stages. Later stages (the larger ones in most networks) go to the later
  workers, the last stage to the last worker, which finishes each step's
  gradients last and so never holds its own contribution waiting for the others'.
- **Visits.** A worker's consecutive ops on one stage (a whole backward's last
  stage F and B, a split backward's B and W) read one version and form one visit;
  the stage's parameters are fetched once per visit.
- **Relay.** At the start of a visit's first tick the owner sends the version the
  visit reads (its current or previous version, the table's `slot`: both hold
  what the table names because the owner applies each update at the table's
  update tick) to the visiting worker, one message of the stage's real size; the
  owner's own visits read its copy. A worker holds a relayed stage only during its
  visit.
- **Gradients.** The workers that are not the owner finish the stage's gradient
  op one after another; a running partial sum hops from each to the next as they
  finish (end of tick), and from the last of them to the owner, who adds its own
  contribution (kept since its own gradient op, unless it finishes last) and
  applies the update at the end of the update tick: N-1 messages of the stage's
  size per stage and step, the ring all-reduce's share.

So per step each worker sends about 2(N-1)/N of the model in parameters (one hop per
visit that is not the owner's, two visits per stage and worker) and (N-1)/N in
gradients: ZeRO-3's all-gathers and reduce-scatter, point to point, at the table's ticks.
"""
from __future__ import annotations

import dataclasses
import functools

from cdpjax.errors import ConfigError
from cdpjax.kinds import gradient_kind
from cdpjax.layouts import Layout, register
from cdpjax.layouts.cdp import TICKS, cdp_table, check_sizes
from cdpjax.timetable import Message, TimeTable

ZERO_RULES = ("cdp-v1", "cdp-v2")


def _check_zero(rule, workers, stages, ticks="whole"):
    if rule not in ZERO_RULES:
        raise ConfigError(f"cdp-zero rule={rule!r} is not one of {', '.join(ZERO_RULES)}")
    if ticks not in TICKS:
        raise ConfigError(f"cdp_ticks={ticks!r} is not one of {', '.join(TICKS)}")
    check_sizes(workers, stages, ticks)


def owners_of(workers: int, stages: int) -> tuple[int, ...]:
    """Stage j's owner: the last stages on the last workers, at most ceil(L/N) stages each."""
    return tuple((workers - stages + j) % workers for j in range(stages))


@dataclasses.dataclass(frozen=True)
class Visit:
    """A worker's consecutive ops on one stage: their ticks, kinds, step and the version (and the
    owner's row holding it: 0 current, 1 previous) they read."""

    worker: int
    stage: int
    step: int
    ticks: tuple[int, ...]
    kinds: tuple[str, ...]
    version: int
    row: int


@dataclasses.dataclass(frozen=True)
class GradientHop:
    """A running partial sum of `stage`'s gradient for `step`, sent at the end of `tick`."""

    tick: int
    stage: int
    step: int
    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """The plan of a table (module docstring): its visits, gradient hops, update ticks, owners
    and the versions owners store (2 where some visit reads the previous one)."""

    table: TimeTable
    owners: tuple[int, ...]
    visits: tuple[Visit, ...]
    hops: tuple[GradientHop, ...]
    update_tick: dict
    versions: int

    def relayed(self):
        """The visits whose parameters come from their owner by a message."""
        return [v for v in self.visits if v.worker != self.owners[v.stage]]


@functools.lru_cache(maxsize=64)
def zero_plan(rule: str, workers: int, stages: int, ticks: str = "whole", steps: int = 8) -> ZeroPlan:
    _check_zero(rule, workers, stages, ticks)
    base = cdp_table(rule, workers, stages, steps, ticks)
    owners = owners_of(workers, stages)
    visits = _visits(base)
    for v in visits:  # every op of a visit reads one version, and the owner holds it
        if v.row not in (0, 1):
            raise AssertionError(f"cdp-zero {rule}: visit {v} reads a version its owner does not store")
    grad = gradient_kind(ticks == "split")
    by = {}
    for o in base.ops:
        if o.kind == grad:
            by.setdefault((o.stage, o.step), []).append(o)
    hops = []
    for (j, k), ops in by.items():
        ops.sort(key=lambda o: o.tick)
        others = [o for o in ops if o.device != owners[j]]
        for a, b in zip(others, others[1:] + [None]):
            hops.append(GradientHop(a.tick, j, k, a.device, b.device if b is not None else owners[j]))
    update_tick = {(u.stage, u.step): u.tick for u in base.updates}
    versions = 2 if any(v.row == 1 for v in visits) else 1
    return ZeroPlan(base, owners, tuple(visits), tuple(sorted(hops, key=lambda h: (h.tick, h.stage))), update_tick,
                    versions)


def _visits(base: TimeTable) -> list[Visit]:
    by_worker = {}
    for o in sorted(base.ops, key=lambda o: o.tick):
        by_worker.setdefault(o.device, []).append(o)
    out = []
    for w, ops in by_worker.items():
        group = [ops[0]]
        for o in ops[1:]:
            prev = group[-1]
            if o.stage == prev.stage and o.step == prev.step and o.tick == prev.tick + 1:
                group.append(o)
                continue
            out.append(_visit(group))
            group = [o]
        out.append(_visit(group))
    return sorted(out, key=lambda v: (v.ticks[0], v.worker))


def _visit(ops) -> Visit:
    first = ops[0]
    if any(o.version != first.version for o in ops):
        raise AssertionError(f"the ops {ops} of one visit read different versions")
    row = {"current": 0, "previous": 1}.get(first.slot, -1)
    return Visit(first.device, first.stage, first.step, tuple(o.tick for o in ops), tuple(o.kind for o in ops),
                 first.version, row)


def cdp_zero_table(workers: int = 4, stages: int = 4, steps: int = 3, rule: str = "cdp-v2",
                   ticks: str = "whole") -> TimeTable:
    """cdp-zero's table: the `rule` table (same ops, versions, updates) with the plan's
    messages: a 'param' message from the owner at the start of each visit that is not the
    owner's (sent at the end of the tick before), the 'partial' sums to the owner."""
    _check_zero(rule, workers, stages, ticks)
    plan = zero_plan(rule, int(workers), int(stages), ticks, max(int(steps), 1) + 2)
    base = cdp_table(rule, workers, stages, steps, ticks)
    messages = [Message(v.ticks[0] - 1, plan.owners[v.stage], v.worker, v.stage, "param", v.step)
                for v in plan.relayed() if v.step < steps and v.ticks[0] >= 1]
    messages += [Message(h.tick, h.src, h.dst, h.stage, "partial", h.step) for h in plan.hops
                 if h.step < steps and h.tick < base.num_ticks]
    messages.sort(key=lambda m: (m.tick, m.kind != "partial", m.stage, m.src))
    owned = "; ".join(f"stage {j}: w{o}" for j, o in enumerate(plan.owners))
    note = (f"rule {rule}; owners (parameters, {plan.versions} stored version(s), optimizer state): {owned}; "
            f"each visit that is not its owner's gets the stage from the owner, one message of the stage's size")
    T = base.period
    steady = (T, 2 * T) if steps >= 2 else base.steady
    meta = {"rule": rule, "owners": list(plan.owners), "stored_versions": plan.versions}
    if ticks != "whole":
        meta["ticks"] = ticks
    return dataclasses.replace(base, method="cdp-zero", messages=tuple(messages), steady=steady, meta=meta,
                               notes=(note,))


register(Layout("cdp-zero", "cdpjax.methods.cdp_zero:build", axes=("data",), device_axis="data",
                table=cdp_zero_table, colour="worker", label="{kind}{stage}", diagram_label="{kind}w{micro}",
                columns="worker", legend="F<j>/B<j>/W<j>: forward/backward/weight gradient of stage j",
                title="{method}: N={workers} workers, L={stages} stages, {steps} steps, offsets {offsets}",
                summary="CDP with each stage's parameters and optimizer state on one owner, relayed point to point"))
