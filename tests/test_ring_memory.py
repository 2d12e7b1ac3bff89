"""The scanned ring's held memory: each worker's gradient sums in its own pool (`RingPool`), placed
so that every read finds what the last write put there, and the compiled step holding about dp's
memory (CDP's flat-memory claim), not every sum of every worker for the whole period."""
import jax
import pytest

from cdpjax.layouts.cdp import cdp_table
from cdpjax.program.ring import op_order, ring_pool, ring_routing, ring_ticks


def replay(rule: str, workers: int, stages: int, ticks: str = "whole") -> tuple[list, int]:
    """The period's events run over several periods on each worker's pool, element by element,
    beside a store keyed by what each buffer is: (kind, stage, step, worker). Every write puts a
    fresh token in its elements; every read must find, in every element, the token the store holds
    for that buffer (a buffer sharing bytes with one still alive would have overwritten it). The
    events in the runtime's order: ops (in `op_order`; a gradient op reads its partial sum unless it
    starts one and writes its partial or completed sum), applies before the sends, the sends (each
    receiver writes what its sender read), applies after them, and at a period's end the pool's
    moves (all read, then all written). Returns the mismatches after the first periods (steps
    before the first have no writes) and the pool's size."""
    period = ring_ticks(cdp_table(rule, workers, stages, 3, ticks=ticks))
    routing = ring_routing(period)
    sizes = [5 + 3 * j for j in range(stages)]  # unequal: a buffer over another's bytes shows
    pool = ring_pool(period, routing, sizes)
    assert pool.size >= max(o + sizes[j] for (_, (_, j, _)), at in pool.at.items() for o in at)
    store, memory, bad, token = {}, [dict() for _ in range(workers)], [], iter(range(1, 10 ** 9))

    def write(w, offset, j, value):
        for e in range(offset, offset + sizes[j]):
            memory[w][e] = value

    def read(w, offset, j, name, per, t):
        want = store.get((name[0], name[1], per - name[2], w))
        got = {memory[w].get(e) for e in range(offset, offset + sizes[j])}
        if per > period.max_lag + 1 and want is not None and got != {want}:
            bad.append((per, t, w, name))
        return want

    for per in range(2 * period.max_lag + 6):
        for t, tk in enumerate(period.ticks):
            done = {(c.worker, c.stage, c.lag) for c in tk.completes}
            position = [0] * workers
            for o in op_order(tk):
                k, position[o.worker] = position[o.worker], position[o.worker] + 1
                if o.kind in tk.gradient_kinds:
                    if (o.worker, o.stage) not in tk.chain_start:
                        read(o.worker, pool.op_read[t, o.worker, k], o.stage, ("partial", o.stage, o.lag), per, t)
                    kind = "sum" if (o.worker, o.stage, o.lag) in done else "partial"
                    store[(kind, o.stage, per - o.lag, o.worker)] = value = next(token)
                    write(o.worker, pool.op_write[t, o.worker, k], o.stage, value)
            for phase in (0, 1):
                if phase == 1:
                    for kind, j, lag, pairs in ([("partial", *p) for p in tk.partials]
                                                + [("sum", j, lag, pairs) for j, lag, pairs, _ in tk.sums]):
                        at = pool.at[(t, (kind, j, lag))]
                        sent = {d: read(s, at[s], j, (kind, j, lag), per, t) for s, d in pairs}
                        for d, value in sent.items():
                            store[(kind, j, per - lag, d)] = value
                            write(d, at[d], j, value)
                for w in range(workers):
                    for a in range(routing.apply_stage.shape[-1]):
                        j = routing.apply_stage[phase, t, w, a]
                        if j < stages:
                            read(w, pool.apply_at[phase, t, w, a], j, ("sum", j, routing.apply_lag[phase, t, w, a]),
                                 per, t)
        moved = [[[memory[w].get(e) for e in range(m.source[w], m.source[w] + m.size)] for w in range(workers)]
                 for m in pool.moves]
        for m, values in zip(pool.moves, moved):
            for w in (w for w in range(workers) if m.held[w]):
                for e, value in zip(range(m.target[w], m.target[w] + m.size), values[w]):
                    memory[w][e] = value
    # at least the most a worker holds at once (the pool the program declares), the first fit within 15% of it
    least = max(max(sum(sizes[j] for j in group) for group in pool.held), max(sizes))
    assert least <= pool.size <= 1.15 * least, (pool.size, least)
    return bad, pool.size


@pytest.mark.parametrize("rule,workers,stages,ticks", [
    ("cdp-v2", 2, 4, "whole"), ("cdp-v2", 4, 4, "whole"), ("cdp-v2", 8, 4, "whole"), ("cdp-v1", 4, 4, "whole"),
    ("paper-code", 8, 4, "whole"), ("cdp-v2", 4, 4, "split"), ("cdp-v2", 4, 4, "paired"), ("cdp-v2", 4, 8, "whole")])
def test_each_read_of_a_workers_pool_finds_the_last_write(rule, workers, stages, ticks):
    bad, _ = replay(rule, workers, stages, ticks)
    assert not bad, bad[:5]


def test_a_workers_pool_holds_what_it_needs_at_once_not_every_workers_sums():
    """At N = 8, L = 8, each CDP-v2 worker holds at most a running and a completed sum of a few
    stages at once: its pool is well under the 2L stage sums (a running and a completed sum of every
    stage) that one slot per name shared by every worker held."""
    _, size = replay("cdp-v2", 8, 8)
    every_stage_twice = 2 * sum(5 + 3 * j for j in range(8))
    assert size <= 0.6 * every_stage_twice, (size, every_stage_twice)


def held_over_dp(model: str, devices: int, method: str = "cdp-v2", **config) -> float:
    """XLA's held bytes per device of the compiled step (arguments + temporaries, as bench computes
    them) of `method` as one ring of `devices` workers over dp's on the same devices, L = 4."""
    from cdpjax import bench
    from cdpjax.config import default_config

    held = {}
    for name in ("dp", method):
        c = default_config()
        c.method, c.model, c.stages, c.global_batch_size = name, model, 4, 2 * devices
        c.mesh.data, c.eval_every, c.checkpoint_every = devices, 0, 0
        for k, v in config.items():
            c[k] = v
        held[name] = bench.memory(bench._prepare(c, jax.devices()[:devices])["compiled"])["held_bytes"]
    return held[method] / held["dp"]


@pytest.mark.parametrize("method,devices", [("cdp-v2", 4), ("cdp-v2", 8), ("cdp-v1", 4)])
def test_the_ring_holds_at_most_one_and_a_half_times_dps_memory(method, devices):
    """CDP's claim is dp's memory: per device, dp holds its parameters, optimizer state and one
    gradient (3 models with momentum, and its step's temporaries); a ring worker holds the same
    parameters and optimizer state, and instead of one gradient the sums it has in flight, at most a
    running and a completed sum of every stage (2 models) and, where sums are placed per worker, what
    it needs at once (1.55 models at N = 4, L = 4 for the MLP's unequal stages), plus one stage's
    gradient row and the bytes it overwrites. So the ring holds at most dp's memory plus about one
    model: under 1.5x dp's (the issue's target). Measured before the per-worker pool: 2.40x dp (N = 4);
    with the pool but the switches returning it, 1.99x. cdp-v1, whose sums outlive a period (moved
    in the pool at its end), held its pool twice while the moves read every source first: 2.28x."""
    ratio = held_over_dp("mlp", devices, method)
    assert ratio <= 1.5, f"the ring holds {ratio:.2f}x dp's memory"
