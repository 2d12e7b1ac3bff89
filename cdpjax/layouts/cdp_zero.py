"""cdp-zero: CDP's ops with every stage's parameters and optimizer state partitioned over the N
workers, as ZeRO-3 partitions each parameter over its data-parallel ranks, gathered point to point
for each visit and reduce-scattered point to point after each gradient op (pure Python: the plan
and its table).

The plan (`zero_plan`) of a cyclic table (cdp-v1 or cdp-v2, whole or split backwards):

- **Shards.** Stage j's flattened parameters, padded to N equal pieces, piece i kept by
  worker i (with the previous version where some op reads it, and the optimizer state
  of that piece): every worker keeps 1/N of every stage, 1/N of the model, each piece in
  its natural shape (the same on every device, so one SPMD program needs no padding to
  the largest stage; a stage kept whole by one owner would, and ResNet-18's last block
  alone is 0.42 of the model).
- **Visits.** A worker's consecutive ops on one stage (a whole backward's last stage F
  and B, a split backward's B and W) read one version and form one visit.
- **Gather.** At the start of a visit's first tick every other worker sends its piece of
  the version the visit reads (its current or previous version, the table's `slot`: each
  holds what the table names because every worker applies the update of its pieces at the
  table's update tick) to the visiting worker, N - 1 messages of a piece's size; the
  visitor adds its own piece and holds the whole stage for the visit only.
- **Reduce-scatter.** After a gradient op the worker keeps the piece of its gradient that
  is its own and sends piece i to worker i (N - 1 messages of a piece's size, end of the
  tick); each worker adds what it receives to its running sum of its pieces, which after
  the last worker's op of the step (the update tick) holds the sum over the N workers:
  every worker then applies the update of its pieces. One running sum per stage suffices:
  a stage's next step starts after its update (`zero_plan` checks it).

So per step each worker sends (N-1)/N of a stage per visit in parameters (two visits per
stage and step, the last stage's F and B one: (N-1)/N x (2 - the last stage's share) of the
model) and (N-1)/N of the model in gradients: ZeRO-3's all-gathers and reduce-scatter, point
to point, at the table's ticks.
"""
from __future__ import annotations

import dataclasses
import functools

from cdpjax.errors import ConfigError
from cdpjax.kinds import gradient_kind
from cdpjax.layouts import Layout, Reference, register
from cdpjax.layouts.cdp import cdp_table, check_sizes
from cdpjax.program.zero import Visit, visits
from cdpjax.timetable import Message, TimeTable

ZERO_RULES = ("cdp-v1", "cdp-v2")


def _check_zero(rule, workers, stages, ticks="whole"):
    if rule not in ZERO_RULES:
        raise ConfigError(f"cdp-zero rule={rule!r} is not one of {', '.join(ZERO_RULES)}")
    check_sizes(workers, stages, ticks)


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """The plan of a table (module docstring): its visits, each step's gradient ops per stage
    ((stage, step) -> [(tick, worker)], in tick order), update ticks and the versions every worker
    stores of its pieces (2 where some visit reads the previous one)."""

    table: TimeTable
    visits: tuple[Visit, ...]
    gradients: dict
    update_tick: dict
    versions: int


@functools.lru_cache(maxsize=64)
def zero_plan(rule: str, workers: int, stages: int, ticks: str = "whole", steps: int = 8) -> ZeroPlan:
    _check_zero(rule, workers, stages, ticks)
    base = dataclasses.replace(cdp_table(rule, workers, stages, steps, ticks), applies=())
    found = visits(base)  # every op of a visit reads one version, and every worker stores it
    grad = gradient_kind(ticks == "split")
    gradients = {}
    for o in sorted(base.ops, key=lambda o: o.tick):
        if o.kind == grad:
            gradients.setdefault((o.stage, o.step), []).append((o.tick, o.device))
    update_tick = {(u.stage, u.step): u.tick for u in base.updates}
    for (j, k), ops in gradients.items():  # one running sum per stage: a step's sum is applied before the next's
        u = update_tick.get((j, k))
        later = gradients.get((j, k + 1))
        if u is not None and (ops[-1][0] > u or (later and later[0][0] <= u)):
            raise AssertionError(f"cdp-zero {rule}: stage {j}'s gradient sums of steps {k} and {k + 1} overlap")
    versions = 2 if any(v.row == 1 for v in found) else 1
    return ZeroPlan(base, tuple(found), {k: tuple(v) for k, v in gradients.items()}, update_tick, versions)


def cdp_zero_table(workers: int = 4, stages: int = 4, steps: int = 3, rule: str = "cdp-v2",
                   ticks: str = "whole") -> TimeTable:
    """cdp-zero's table: the `rule` table (same ops, versions, updates) with the plan's
    messages: a 'param' piece from every other worker at the start of each visit (sent at the
    end of the tick before), a 'partial' piece of each gradient op's gradient to every other
    worker, the keeper of that piece."""
    _check_zero(rule, workers, stages, ticks)
    plan = zero_plan(rule, int(workers), int(stages), ticks, max(int(steps), 1) + 2)
    base = cdp_table(rule, workers, stages, steps, ticks)
    others = lambda w: [u for u in range(workers) if u != w]  # noqa: E731
    messages = [Message(v.ticks[0] - 1, u, v.worker, v.stage, "param", v.step, workers)
                for v in plan.visits if v.step < steps and v.ticks[0] >= 1 for u in others(v.worker)]
    messages += [Message(t, w, u, j, "partial", k, workers) for (j, k), ops in plan.gradients.items() if k < steps
                 for t, w in ops if t < base.num_ticks for u in others(w)]
    messages.sort(key=lambda m: (m.tick, m.kind != "partial", m.stage, m.src, m.dst))
    note = (f"rule {rule}; every worker keeps 1/{workers} of every stage (parameters, {plan.versions} stored "
            f"version(s), optimizer state); a visit gathers the stage's other pieces, one message from each "
            f"worker; a gradient op sends each worker its piece of the gradient")
    T = base.period
    steady = (T, 2 * T) if steps >= 2 else base.steady
    meta = {"rule": rule, "shards": workers, "stored_versions": plan.versions}
    if ticks != "whole":
        meta["ticks"] = ticks
    # every worker applies each update of its pieces at the update's tick: no per-worker applies
    return dataclasses.replace(base, method="cdp-zero", messages=tuple(messages), steady=steady, meta=meta,
                               notes=(note,), applies=())


register(Layout("cdp-zero", "cdpjax.methods.cdp_zero:build", axes=("data",), device_axis="data",
                table=cdp_zero_table, colour="worker", label="{kind}{stage}", diagram_label="{kind}w{micro}",
                columns="worker", legend="F<j>/B<j>/W<j>: forward/backward/weight gradient of stage j",
                title="{method}: N={workers} workers, L={stages} stages, {steps} steps, offsets {offsets}",
                summary="CDP with every stage partitioned over the workers (ZeRO-3), gathered and "
                        "reduce-scattered point to point", reference=Reference("{cdp_rule}", (("cdp_impl", "ring"),)),
                # each gradient piece goes to its keeper and each parameter piece to every reader
                messages_per_op="workers"))
