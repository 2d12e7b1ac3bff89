"""`cdp-random`: CDP under random and asynchronous delays, each delay model a table generator.

Every model lays out N workers running CDP's step (`cdpjax.layouts.cdp.phase_ops`: the forwards
of stages 0..L-1, then the backwards) and says which version of each stage every forward reads;
the backward reads the version its forward read. The update rule is CDP's, whatever the model:

    theta^j_{k+1} = opt^j(theta^j_k, mean_i g_i^j(theta_{k - tau(k, i, j)}))

with tau(k, i, j) >= 0 the staleness of worker i's read of stage j at step k (a read of a version
before 0 is of theta_0: the read version is max(k - tau, 0)). The models (`Delay.model`):

- 'uniform': CDP's own table (`cdp_table`, `Delay.rule` 'cdp-v1' or 'cdp-v2'), unchanged: tau is
  1 on the stale pairs of the rule, 0 elsewhere. Reduces to cdp-v1 / cdp-v2 by construction.
- 'jitter': every worker's step k starts `J(k, i)` ticks after CDP's offset, J uniform on
  {0..jitter}, each step followed by `jitter` idle ticks (so that a worker's steps never
  overlap); each forward reads the newest version complete before its tick (cdp-v2's rule).
  jitter = 0: cdp-v2.
- 'uniform-tau', 'geometric', 'per-stage': tau drawn per read, independent of the ticks (CDP's
  whole-step layout, the versions from the draw: reads CDP's timing could not serve yet are
  simulated, like the paper-code rule's): uniform on {0..tau_max}; geometric,
  P(tau = t) proportional to p (1-p)^t on {0..tau_max}; a fixed tau_j per stage (`taus`).
  tau_max = 0 (or every tau_j = 0): dp; per-stage with every tau_j = 1: cdp-v1.
- 'async': an event simulation. Each op of worker i takes a duration drawn uniformly from
  {1..durations} ticks, workers start at CDP's offsets and run their ops back to back, a
  forward of stage j at step k waits until version k - tau_max of stage j is complete
  (bounded staleness), stage j's update for step k is complete at the end of the last worker's
  gradient op of it, and every read takes the newest version complete before its tick. Time and
  staleness come out of one simulation (`meta['time']`). durations = 1: cdp-v2 (with
  tau_max >= 1).
- 'straggler': 'async' with worker `worker`'s ops taking `slowdown` ticks and the others' one.
  slowdown = 1: cdp-v2.

An op of d ticks is drawn at its first tick (the grid shows when it starts). `meta['time']`
of the timed models: the ticks the table takes, and the ticks dp would take with the same
durations (dp waits at every all-reduce for its slowest worker: a step lasts the longest of the
workers' sums of durations). The tables of the models whose staleness changes from step to step
hold no gradient messages: the ring runs their reads as per-step depths on the program of
`ring_carrier` (`cdpjax.methods.cdp_random`). 'per-stage' with every tau_j >= 1 carries CDP's ring
traffic (each worker applies update k between its reads of versions k and k + 1), and the ring
runs it as it is.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.kinds import gradient_kind
from cdpjax.layouts import Layout, Reference, register
from cdpjax.layouts.cdp import _CDP_LOOK, cdp_table, phase_ops, worker_offsets
from cdpjax.layouts.cdp_delivery import check_one_version, delivery, messages_and_applies
from cdpjax.timetable import Apply, Message, Op, TimeTable, Update, positive

MODELS = ("uniform", "jitter", "uniform-tau", "geometric", "per-stage", "async", "straggler")
READ_MODELS = ("uniform-tau", "geometric", "per-stage")  # tau drawn per read, not from the ticks
TIMED_MODELS = ("async", "straggler")  # the event simulation
UNIFORM_RULES = ("cdp-v1", "cdp-v2")
DEFAULT_STEPS = 16


def at_mean_delay(model: str, tau: int, stages: int) -> dict:
    """The `config.delay` block of `model` at nominal mean delay `tau` (tau = 0: every read
    fresh, dp): uniform-tau on {0..2 tau} (mean tau); geometric with p = 1 / (1 + tau) (mean tau
    before its bound 4 tau); per-stage with tau at every one of `stages`; a straggler (4 ticks an
    op) bounded at tau; async's op durations uniform on 1..2 tau ticks, bounded at tau (the
    realised means of both timed models are below tau: async's stay near cdp-v2's, its workers
    drift apart only as a random walk)."""
    if model == "uniform-tau":
        return {"model": model, "tau_max": 2 * tau}
    if model == "geometric":
        return {"model": model, "p": 1.0 / (1 + tau), "tau_max": 4 * tau}
    if model == "per-stage":
        return {"model": model, "taus": (tau,) * stages}
    if model == "async":
        return {"model": model, "durations": 2 * tau, "tau_max": tau}
    if model == "straggler":
        return {"model": model, "slowdown": 4, "tau_max": tau}
    raise ConfigError(f"delay model {model!r} has no nominal mean delay: use one of "
                      f"{', '.join(READ_MODELS + TIMED_MODELS)}")


@dataclasses.dataclass(frozen=True)
class Delay:
    """A delay model and its parameters (module docstring): what `config.delay` holds.

    model: one of MODELS. rule: 'uniform's CDP rule. tau_max: the bound on a read's staleness
    (uniform-tau, geometric, async, straggler). p: geometric's P(tau = 0) before truncation.
    taus: per-stage's tau of each stage. jitter: the most ticks a step's start moves. durations:
    async's longest op, in ticks. worker, slowdown: the straggler and its ticks per op. seed: the
    draws'. correction: the delay correction the trainer applies (`cdpjax.delay_corrections`;
    no table reads it). strength: the correction's coefficient (dc-asgd's lambda, pipenag's look-ahead).
    """

    model: str = "uniform"
    rule: str = "cdp-v2"
    tau_max: int = 2
    p: float = 0.5
    taus: tuple[int, ...] = ()
    jitter: int = 1
    durations: int = 2
    worker: int = 0
    slowdown: int = 2
    seed: int = 0
    correction: str = "none"
    strength: float = 1.0

    def __post_init__(self):
        if self.model not in MODELS:
            raise ConfigError(f"delay.model={self.model!r} is not one of {', '.join(MODELS)}")
        if self.rule not in UNIFORM_RULES:
            raise ConfigError(f"delay.rule={self.rule!r} is not one of {', '.join(UNIFORM_RULES)}")
        for name in ("tau_max", "jitter", "worker", "seed"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(f"delay.{name}={getattr(self, name)!r} must be an integer >= 0")
        for name in ("durations", "slowdown"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"delay.{name}={getattr(self, name)!r} must be an integer >= 1")
        if not 0.0 < float(self.p) <= 1.0:
            raise ConfigError(f"delay.p={self.p!r} must be in (0, 1]")
        if any(not isinstance(t, int) or t < 0 for t in self.taus):
            raise ConfigError(f"delay.taus={self.taus!r} must be integers >= 0, one per stage")

    @classmethod
    def of(cls, value) -> "Delay":
        """A Delay from a Delay, a mapping (a ConfigDict block) or 'model=geometric,p=0.5,...' text;
        an unknown key is refused, naming the known ones."""
        if isinstance(value, Delay):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            value = dict(item.split("=", 1) for item in value.split(",") if "=" in item)
        items = dict(value.items()) if hasattr(value, "items") else None
        if items is None:
            raise ConfigError(f"delay={value!r} must be a mapping or 'model=NAME,key=value,...'")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(items) - set(fields))
        if unknown:
            raise ConfigError(f"delay has no {', '.join(unknown)}; it takes {', '.join(fields)}")
        return cls(**{k: _typed(k, v, fields[k].default) for k, v in items.items()})

    def reads_per_stage_only(self) -> bool:
        """Whether each (worker, stage) pair reads with one staleness at every step."""
        return self.model in ("uniform", "per-stage")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "taus": list(self.taus)}


def _typed(name: str, value, default):
    """A config value as the field's type (text from the command line, lists from JSON)."""
    try:
        if isinstance(default, tuple):
            if isinstance(value, str):
                value = [v for v in value.replace("[", "").replace("]", "").replace(";", ":").split(":") if v]
            return tuple(int(v) for v in value)
        if isinstance(default, bool):
            return bool(value)
        if isinstance(default, int) and isinstance(value, str):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"delay.{name}={value!r} is not a {type(default).__name__}") from None
    return value


# ------------------------------------------------------------------- the draws


def staleness_draws(delay: Delay, steps: int, workers: int, stages: int) -> np.ndarray:
    """[steps, workers, stages] the drawn staleness of every read of a read model (seeded)."""
    rng = np.random.default_rng(delay.seed)
    shape = (steps, workers, stages)
    if delay.model == "uniform-tau":
        return rng.integers(0, delay.tau_max + 1, size=shape)
    if delay.model == "geometric":
        return rng.choice(delay.tau_max + 1, size=shape, p=geometric_pmf(delay.p, delay.tau_max))
    if len(delay.taus) != stages:
        raise ConfigError(f"delay.taus={list(delay.taus)} has {len(delay.taus)} entries; give one per stage "
                          f"({stages})")
    return np.broadcast_to(np.asarray(delay.taus, int), shape).copy()


def geometric_pmf(p: float, tau_max: int) -> np.ndarray:
    """P(tau = t) proportional to p (1-p)^t on {0..tau_max}."""
    w = float(p) * (1.0 - float(p)) ** np.arange(tau_max + 1)
    return w / w.sum()


# ------------------------------------------------------------------- the tables


def delay_table(workers: int = 4, stages: int = 4, steps: int = DEFAULT_STEPS, delay=None,
                ticks: str = "whole") -> TimeTable:
    """The `cdp-random` table of the delay model `delay` (a `Delay`, a mapping or 'key=value,...'
    text; module docstring), N workers, L stages, `steps` steps, `ticks` CDP's ops per tick."""
    d = Delay.of(delay)
    positive(workers=workers, stages=stages, steps=steps)
    N, L, S = int(workers), int(stages), int(steps)
    if d.model == "uniform":
        t = cdp_table(d.rule, N, L, S, ticks)
        return dataclasses.replace(t, method="cdp-random", meta={**t.meta, "delay": d.to_json()})
    phases = phase_ops(L, ticks)
    if d.model in READ_MODELS:
        tau = staleness_draws(d, S, N, L)
        if d.model == "per-stage" and min(d.taus, default=0) >= 1:  # every read causal: the ring's traffic
            ahead = max(d.taus) + 2  # steps laid out past the table's own, to find the windows of its last updates
            long = _read_table(d, N, L, S + ahead, phases, staleness_draws(d, S + ahead, N, L))
            return _with_ring_traffic(long, S)
        return _read_table(d, N, L, S, phases, tau)
    if d.model == "straggler" and d.worker >= N:
        raise ConfigError(f"delay.worker={d.worker} is not a worker: choose one in 0..{N - 1}")
    return _timed_table(d, N, L, S, phases)


def _read_table(d: Delay, N, L, S, phases, tau, gap: int = 0) -> TimeTable:
    """CDP's whole-step layout (cdp-v1's ticks and updates), each read's version from `tau`; with
    `gap`, each step followed by that many idle ticks (the period T + gap: `ring_carrier`)."""
    T = len(phases) + gap
    offsets = worker_offsets("cdp-v1", N, L, period=len(phases))
    grad = gradient_kind(any(kind == "W" for tick in phases for kind, _ in tick))
    placed = [(offsets[i] + T * k + p, i, j, kind, k) for k in range(S) for i in range(N)
              for p, tick_ops in enumerate(phases) for kind, j in tick_ops]
    update_tick = {}
    for t, i, j, kind, k in placed:
        if kind == grad:
            update_tick[(j, k)] = max(update_tick.get((j, k), -1), t)
    constant = d.reads_per_stage_only()
    complete = _completion_ticks(update_tick, L)
    ops = [Op(t, i, j, kind, k, micro=i, version=max(k - int(tau[k, i, j]), 0),
              slot=_slot(max(k - int(tau[k, i, j]), 0), t, j, complete),
              stale=bool(constant and tau[k, i, j] > 0)) for t, i, j, kind, k in placed]
    return _table(d, N, L, S, T, ops, update_tick, offsets)


def ring_carrier(workers: int, stages: int, ticks: str = "whole", steps: int = 8) -> TimeTable:
    """The table whose ring program runs every delay model's reads (`cdpjax.methods.cdp_random`'s
    ring): CDP's whole-step layout (cdp-v1's offsets and ops) with every read fresh (version k at
    step k: per-stage with every tau 0, dp's reads) and CDP's ring traffic (running sums hopping
    worker to worker, the completed sum chained to every worker), its steps spaced `gap` idle
    ticks apart, the fewest for which every worker applies update k - 1 before its first read of
    step k. On it, a read tau updates behind is the version tau applies before the newest its
    worker stores, at every step: the ring reads the model's staleness per step as that depth.
    Refused in one line where no gap up to 4 (2L + N) ticks serves every read."""
    from cdpjax.program.ring import lower_ring  # the ring's own check of each candidate

    positive(workers=workers, stages=stages, steps=steps)
    N, L, S = int(workers), int(stages), int(steps)
    d = Delay(model="per-stage", taus=(0,) * L)
    phases = phase_ops(L, ticks)
    ahead = 2  # steps laid out past the table's own, to find the windows of its last updates
    for gap in range(4 * (len(phases) + N)):
        t = _with_ring_traffic(_read_table(d, N, L, S + ahead, phases, np.zeros((S + ahead, N, L), int), gap), S)
        if not t.applies:
            continue
        try:
            lower_ring(t)
        except ConfigError:  # a plan in time, but not one the ring's hops serve (two workers on one tick)
            continue
        return dataclasses.replace(t, notes=(f"every read fresh, steps {gap} ticks apart: the ring's carrier of "
                                             f"the delay models' per-step read depths",))
    raise ConfigError(f"no spacing of CDP's steps up to {4 * (len(phases) + N)} idle ticks lets the ring serve "
                      f"every fresh read at N={N}, L={L}, ticks={ticks!r}: use cdp_impl='simulate'")


def _with_ring_traffic(t: TimeTable, S: int) -> TimeTable:
    """`t` (laid out past step S) cut to S steps, with CDP's ring traffic (`cdp_delivery`): each
    stage's running sum hopping worker to worker in the order they finish its gradient op, the
    completed sum chained on to every worker, each applying it between its last read of the old
    version and its first of the new (one stored version). Where no plan serves every read in
    time, the table is `t` cut, with no traffic (simulate only)."""
    grad = gradient_kind(t.split_backward)
    last = {}
    for o in t.ops:
        if o.kind == grad and last.get((o.stage, o.step), (-1,))[0] < o.tick:
            last[(o.stage, o.step)] = (o.tick, o.device)
    completer = {key: w for key, (_, w) in last.items()}
    plans = delivery(t.ops, t.updates, completer, t.workers, t.stages, S, t.period)
    if any(p.late or p.acausal for p in plans.values()):
        return _cut(t, S, (), ())
    sums, applies = messages_and_applies(plans, t.updates)
    check_one_version(t.ops, applies, t.method)
    by = {}
    for o in sorted(t.ops, key=lambda o: o.tick):
        if o.kind == grad:
            by.setdefault((o.stage, o.step), []).append(o)
    partials = [Message(a.tick, a.device, b.device, j, "partial", k) for (j, k), os in by.items()
                for a, b in zip(os, os[1:])]
    return _cut(t, S, partials + sums, [Apply(*a) for a in applies])


def _cut(t: TimeTable, S: int, messages, applies) -> TimeTable:
    """`t`'s first S steps (and the traffic of their updates that falls within their ticks)."""
    ops = tuple(o for o in t.ops if o.step < S)
    num_ticks = max(o.tick for o in ops) + 1
    keep = lambda rows: tuple(sorted((r for r in rows if r.step < S and r.tick < num_ticks),  # noqa: E731
                                     key=lambda r: dataclasses.astuple(r)))
    notes = t.notes if not applies else (f"delay model {t.meta['delay']['model']}: every read of stage j "
                                         f"taus[j] updates behind; the ring runs it (one stored version per stage)",)
    return dataclasses.replace(t, steps=S, num_ticks=num_ticks, ops=ops,
                               updates=tuple(u for u in t.updates if u.step < S),
                               messages=keep(messages), applies=keep(applies), notes=notes)


def _slot(version: int, tick: int, stage: int, complete: dict) -> str:
    """Where the read version stands at its tick: the newest complete ('current'), one older
    ('previous'), older still ('older'), or an update not complete yet ('future': simulate only).
    `complete[stage]`: the sorted ticks of the stage's updates."""
    complete = int(np.searchsorted(complete[stage], tick))
    return ("current" if version == complete else "previous" if version == complete - 1
            else "future" if version > complete else "older")


def _completion_ticks(update_tick: dict, L: int) -> dict:
    """stage -> the sorted ticks at whose end its updates are complete."""
    return {j: sorted(u for (s, _), u in update_tick.items() if s == j) for j in range(L)}


def _timed_table(d: Delay, N, L, S, phases) -> TimeTable:
    """The jitter model and the event simulation (async, straggler): ticks first, then each read
    takes the newest version complete before its tick."""
    T = len(phases)
    flat = [(kind, j) for tick_ops in phases for kind, j in tick_ops]
    rng = np.random.default_rng(d.seed)
    grad = gradient_kind(any(kind == "W" for kind, _ in flat))
    offsets = worker_offsets("cdp-v2", N, L, period=T)
    placed, update_tick, durations = [], {}, {}
    free = list(offsets)  # each worker's first free tick
    for k in range(S):
        if d.model == "jitter":
            starts = [(T + d.jitter) * k + offsets[i] + int(rng.integers(0, d.jitter + 1)) for i in range(N)]
        for i in range(N):
            for p, (kind, j) in enumerate(flat):
                if d.model == "jitter":
                    start, length = starts[i] + p, 1
                else:
                    length = (d.slowdown if i == d.worker else 1) if d.model == "straggler" else \
                        int(rng.integers(1, d.durations + 1))
                    start = free[i]
                    if kind == "F" and k - d.tau_max - 1 >= 0:  # bounded staleness: wait for version k - tau_max
                        start = max(start, update_tick[(j, k - d.tau_max - 1)] + 1)
                free[i] = start + length
                durations[(i, k)] = durations.get((i, k), 0) + length
                placed.append((start, i, j, kind, k))
                if kind == grad:
                    update_tick[(j, k)] = max(update_tick.get((j, k), -1), start + length - 1)
    complete = _completion_ticks(update_tick, L)
    read = {}
    for t, i, j, kind, k in sorted(placed):
        if kind == "F":
            read[(i, j, k)] = min(int(np.searchsorted(complete[j], t)), k)  # updates complete before tick t
    ops = [Op(t, i, j, kind, k, micro=i, version=read[(i, j, k)],
              slot=_slot(read[(i, j, k)], t, j, complete)) for t, i, j, kind, k in placed]
    end = max(free)
    dp_ticks = sum(max(durations[(i, k)] for i in range(N)) for k in range(S))
    time = {"ticks": int(end), "dp_ticks": int(dp_ticks)}
    return _table(d, N, L, S, T, ops, update_tick, offsets, time)


def _table(d: Delay, N, L, S, T, ops, update_tick, offsets, time=None) -> TimeTable:
    ops = tuple(sorted(ops, key=lambda o: (o.tick, o.device)))
    updates = tuple(sorted((Update(u, j, k) for (j, k), u in update_tick.items()), key=lambda u: (u.tick, u.stage)))
    num_ticks = max(max(o.tick for o in ops), max(u.tick for u in updates)) + 1
    meta = {"delay": d.to_json()}
    if time is not None:
        meta["time"] = time
    notes = [f"delay model {d.model}: versions as drawn (see `cdpjax schedule --staleness`); the ring runs them "
             f"as per-step read depths on its carrier (`ring_carrier`)"]
    if d.model in TIMED_MODELS:
        notes.append(f"an op of several ticks is drawn at its first; the table takes {time['ticks']} ticks, dp with "
                     f"the same durations {time['dp_ticks']}")
    steady = (T, 2 * T) if S >= 2 else (0, num_ticks)
    return TimeTable("cdp-random", N, L, S, num_ticks, N, T, ops, updates, (), tuple(offsets), 1, steady,
                     meta=meta, notes=tuple(notes), axis="data")


register(Layout("cdp-random", "cdpjax.methods.cdp_random:build", table=delay_table,
                summary="cyclic data parallel under a delay model (config.delay: uniform, jitter, uniform-tau, "
                        "geometric, per-stage, async, straggler)",
                # the default delay (CDP's uniform offsets) is the rule's own table
                reference=Reference("{delay.rule}", (("cdp_impl", "simulate"),)), **_CDP_LOOK))
