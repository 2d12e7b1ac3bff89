"""Benchmarks: compile time, step time, memory, collectives and table figures, per method.

Everything is measured side by side in one process, so ratios between methods
are meaningful on any machine; on simulated CPU devices (which share the same
cores) absolute times are not results, but the ratio of a parallel method to the
same work on one device is the framework's own overhead.

- memory: `jax.jit(step).lower(...).compile().memory_analysis()` per device.
- collectives: the compiled HLO text, per kind: static count of the ops (an op
  inside a loop body is counted once), bytes of their results, largest one.
- activation, busy fraction, comm balance: from the method's time table.
"""
from __future__ import annotations

import re
import statistics
import time
from typing import Any

import jax
import numpy as np

COLLECTIVES = ("all-reduce", "collective-permute", "all-gather", "reduce-scatter", "all-to-all")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "s16": 2, "s8": 1, "u64": 8,
                "u32": 4, "u16": 2, "u8": 1, "pred": 1, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(f64|f32|f16|bf16|s64|s32|s16|s8|u64|u32|u16|u8|pred|c64|c128)\[([0-9,]*)\]")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
    return total


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per collective kind: static `count`, total result `bytes`, `max_bytes` of one op."""
    out = {k: {"count": 0, "bytes": 0, "max_bytes": 0} for k in COLLECTIVES}
    for line in hlo_text.splitlines():
        if "=" not in line:
            continue
        lhs, rhs = line.split("=", 1)
        for kind in COLLECTIVES:
            # `kind(` or the async `kind-start(`; the matching `-done` is the same transfer.
            m = re.match(rf"\s*(\(.*?\)|\S+)\s+{kind}(-start)?\(", rhs)
            if m:
                nbytes = _shape_bytes(m.group(1))
                if m.group(2):  # async start returns (operand, result, ...): count the result once
                    nbytes //= 2 if kind != "collective-permute" else 1
                rec = out[kind]
                rec["count"] += 1
                rec["bytes"] += nbytes
                rec["max_bytes"] = max(rec["max_bytes"], nbytes)
                break
    return out


def memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return {
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(getattr(m, "alias_size_in_bytes", 0)),
    }


def tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def stage_sizes(net, micro_batch: int) -> dict[str, list[int]]:
    """Per-stage parameter bytes and output-activation bytes for `micro_batch` examples."""
    params, _ = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    act = [int(np.prod(s)) * 4 for s in net.stage_output_shapes(micro_batch)]
    return {"param_bytes": [tree_bytes(p) for p in params], "activation_bytes": act}


def table_figures(table, sizes: dict[str, list[int]]) -> dict[str, Any]:
    """Figures that come from the method's time table ({} where it has none).

    activation_total: over all devices in steady state, `peak` / `mean` in stage-activations
    (the unit model) and `peak_bytes` / `mean_bytes` with each stage's real output bytes;
    `device_peak_bytes` (the largest device's peak), `device_peak_bytes_mean` (the mean of the
    devices' peaks) and `device_mean_bytes` (mean held per device) per device.
    """
    if table is None:
        return {}
    out: dict[str, Any] = {"busy_fraction": float(table.busy_fraction()["devices"])}
    stats = table.activation_stats(sizes["activation_bytes"]) if sizes else table.activation_stats()
    act = {"peak": float(stats["total_peak"]), "mean": float(stats["total_mean"])}
    if sizes:
        act.update(peak_bytes=stats["total_peak_bytes"], mean_bytes=stats["total_mean_bytes"],
                   device_peak_bytes=stats["device_peak_bytes"],
                   device_peak_bytes_mean=stats["device_peak_bytes_mean"],
                   device_mean_bytes=stats["device_mean_bytes"])
    out["activation_total"] = act
    if sizes and table.messages:
        out["comm_balance"] = float(table.comm_balance(sizes["param_bytes"]))
        per_tick = np.asarray(table.bytes_per_tick(sizes["param_bytes"]), float)
        out["bytes_sent_per_worker_per_step"] = float(per_tick.sum() / max(table.workers, 1) / max(table.steps, 1))
    return out


def _padded_figures(method, sizes) -> dict[str, Any]:
    """What the uniform carrier really sends: every relayed gradient is one padded stage row."""
    carrier = method.carrier
    p_max = getattr(carrier, "p_max", None)
    if p_max is None or method.table is None or not hasattr(method.table, "comm_balance"):
        return {}
    padded = {"param_bytes": [int(p_max) * 4] * len(sizes["param_bytes"]), "activation_bytes": sizes["activation_bytes"]}
    figures = table_figures(method.table, padded)
    return {"comm_balance_padded": figures.get("comm_balance"),
            "bytes_sent_per_worker_per_step_padded": figures.get("bytes_sent_per_worker_per_step")}


def time_steps(step_fn, state, batch, warmup: int = 2, repeats: int = 5):
    """Median seconds of `step_fn(state, batch)` after warm-up (state threaded through)."""
    for _ in range(warmup):
        state, out = step_fn(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, out = step_fn(state, batch)
        jax.block_until_ready((state, out))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def bench_method(config, devices=None, warmup: int = 2, repeats: int = 5) -> dict[str, Any]:
    """One record: compile, time, memory, collectives and table figures of `config.method`."""
    from cdpjax import train

    dataset, mesh, method = train.setup(config, devices)
    batch = train.put_batch(dataset.train_batch(0, config.global_batch_size, config.seed, False), mesh,
                            method.input_sharding)
    state = method.init(jax.random.key(config.seed))
    t0 = time.perf_counter()
    # A step that is a Python wrapper around jitted pieces (not a jit itself) is jitted whole here.
    step = method.train_step if hasattr(method.train_step, "lower") else jax.jit(method.train_step)
    lowered = step.lower(state, batch)
    compiled = lowered.compile()
    compile_seconds = time.perf_counter() - t0
    step_seconds, _ = time_steps(compiled, state, batch, warmup, repeats)
    workers = method.workers or 1
    table = method.table
    if table is None:  # a method that does not keep its table: laid out from its layout
        from cdpjax.speedup import table_for

        table = table_for(config, int(mesh.devices.size), method.net.num_stages)
    from cdpjax.layouts import LAYOUTS

    per_step = config.microbatches if LAYOUTS[config.method].microbatches else workers
    sizes = stage_sizes(method.net, max(config.global_batch_size // max(per_step, 1), 1))
    record = {
        "method": config.method,
        "devices": int(method.devices or mesh.devices.size),
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "stages": method.net.num_stages,
        "workers": method.workers,
        "global_batch_size": config.global_batch_size,
        "compile_seconds": compile_seconds,
        "step_seconds": step_seconds,
        "images_per_second": config.global_batch_size / step_seconds,
        "memory": memory(compiled),
        "collectives": collectives(compiled.as_text()),
        "param_bytes": int(sum(sizes["param_bytes"])),
        "stage_param_bytes": sizes["param_bytes"],
        **table_figures(table, sizes),
        **_padded_figures(method, sizes),
        "info": {k: v for k, v in method.info.items() if isinstance(v, (int, float, str, dict, list))},
    }
    return record


def format_table(records: list[dict]) -> str:
    """A readable table with ratios to the first method."""
    if not records:
        return ""
    base = records[0]
    head = ["method", "devices", "compile s", "step s", "x first", "img/s", "temp MiB", "args MiB",
            "busy", "act peak", "comm bal", "all-reduce MiB", "permute MiB"]
    rows = []
    for r in records:
        mem = r.get("memory", {})
        coll = r.get("collectives", {})
        act = r.get("activation_total", {})
        rows.append([
            r["method"], str(r["devices"]), f"{r['compile_seconds']:.1f}", f"{r['step_seconds']:.4f}",
            f"{r['step_seconds'] / base['step_seconds']:.2f}", f"{r['images_per_second']:.0f}",
            f"{mem.get('temp_bytes', 0) / 2**20:.2f}", f"{mem.get('argument_bytes', 0) / 2**20:.2f}",
            f"{r['busy_fraction']:.2f}" if "busy_fraction" in r else "-",
            f"{act['peak']:.1f}" if act else "-",
            f"{r['comm_balance']:.2f}" if "comm_balance" in r else "-",
            f"{coll.get('all-reduce', {}).get('bytes', 0) / 2**20:.3f}",
            f"{coll.get('collective-permute', {}).get('bytes', 0) / 2**20:.3f}",
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    notes = [_layout_note(r) for r in records]
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows), *filter(None, notes)])


def _layout_note(record: dict) -> str:
    """A line for a method on a uniform stage carrier: its padding, and its device count against
    the N*L devices that DP with model parallelism needs for the same workers and stages."""
    info = record.get("info", {})
    padding = info.get("padding")
    if not isinstance(padding, dict):
        return ""
    ratios = ", ".join(f"{k} x{v:.2f}" for k, v in padding.items() if isinstance(v, float))
    note = f"{record['method']}: padding (stored/real) {ratios}"
    if "dp_mp_devices" in info:
        note += (f"; {record['devices']} devices for N={record.get('workers')} workers x L={record['stages']} "
                 f"stages, where DP with model parallelism needs {info['dp_mp_devices']}")
    return note
