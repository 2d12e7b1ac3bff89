"""Benchmarks: compile time, step time, memory, collectives and table figures, per method.

Everything is measured side by side in one process, so ratios between methods
are meaningful on any machine; on simulated CPU devices (which share the same
cores) absolute times are not results, but the ratio of a parallel method to the
same work on one device is the framework's own overhead.

- memory: `jax.jit(step, donate_argnums=0).lower(...).compile().memory_analysis()` per
  device (the state donated, as the trainer runs the step), `held_bytes` what a device holds at
  once, beside the per-device model of what the method must hold (`memory_model`).
- collectives: the compiled HLO text, per kind: static count of the ops (an op
  inside a loop body is counted once), bytes of their results, largest one; and
  the bytes they really send (`traffic`: each transfer counted as often as it
  runs, i.e. times the trip counts of the loops around it, padding and idle
  zeros included): `sent_bytes_hlo_per_device_per_step`; and, for a method with a lowered
  program, the bytes its messages carry (`sent_bytes_per_device_per_step`: exactly what the
  runtime sends) beside the same messages padded to the carrier's rows.
- activation, busy fraction (of the ticks, and of the time in lockstep with a backward of two
  forwards: `busy_fraction_lockstep`), comm balance: from the method's time table (in
  stage-activations, the unit model, and in bytes of each stage's real output).
- step time: every method compiled first, then timed in interleaved rounds, so
  that a change of load on a shared machine falls on all of them alike.
"""
from __future__ import annotations

import collections
import os
import re
import statistics
import sys
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cdpjax import compilation
from cdpjax.kinds import KINDS
from cdpjax.program.events import Compute, Gather, Receive
from cdpjax.program.ring import SENDS_BY_TICK

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


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """HLO computations by name (their instruction lines) and the entry's name."""
    comps, entry, name = {}, "", None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            name = m.group(2)
            comps[name] = []
            if m.group(1):
                entry = name
        elif name is not None and line.startswith("  "):
            comps[name].append(line)
    return comps, entry


def _runs(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per execution of the entry: a while body its
    loop's known trip count times (1 where XLA does not know it), a branch of a conditional
    or a called computation once (an upper bound for branches), except the branches of a
    conditional named `SENDS_BY_TICK` (the scanned ring's sends: branch t at tick t of its
    loop), which share their conditional's runs (each once per pass of the loop)."""
    runs = {entry: 1}
    order = [entry]
    for comp in order:
        for line in comps.get(comp, ()):
            callees = []
            if " while(" in line:
                trip = _TRIP.search(line)
                n = int(trip.group(1)) if trip else 1
                for key in ("body", "condition"):
                    m = re.search(rf"{key}=%?([\w.\-]+)", line)
                    if m:
                        callees.append((m.group(1), n if key == "body" else n + 1))
            else:
                m = re.search(r"branch_computations=\{([^}]*)\}", line)
                if m:
                    branches = m.group(1).split(",")
                    share = 1 / len(branches) if SENDS_BY_TICK in line else 1
                    callees += [(c.strip().lstrip("%"), share) for c in branches]
                for key in ("true_computation", "false_computation", "to_apply", "calls"):
                    m = re.search(rf"{key}=%?([\w.\-]+)", line)
                    if m and " all-reduce" not in line and " reduce" not in line.split("=", 1)[1][:40]:
                        callees.append((m.group(1), 1))
            for callee, n in callees:
                if callee in comps:
                    if callee not in runs:
                        order.append(callee)
                    runs[callee] = runs.get(callee, 0) + runs[comp] * n
    return runs


def _group_size(line: str, devices: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return max(len([x for x in m.group(1).split(",") if x]), 1)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    return int(m.group(2)) if m else devices


def traffic(hlo_text: str, devices: int) -> dict[str, Any]:
    """Bytes the compiled program's collectives send, per execution, summed over devices
    (`total_bytes`) and per device (`per_device_bytes`), by kind; and the largest single
    collective-permute. A collective-permute sends its buffer once per (source, target)
    pair; an all-reduce over n devices 2(n-1)/n of its buffer per device (ring algorithm),
    an all-gather or all-to-all (n-1)/n, a reduce-scatter (n-1) x its result. Each runs as
    often as its computation (`_runs`)."""
    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    by_kind = {k: 0.0 for k in COLLECTIVES}
    largest_permute = 0
    for comp, lines in comps.items():
        n_runs = runs.get(comp, 0)
        for line in lines:
            if "=" not in line:
                continue
            rhs = line.split("=", 1)[1]
            for kind in COLLECTIVES:
                m = re.match(rf"\s*(\(.*?\)|\S+)\s+{kind}(-start)?\(", rhs)
                if not m:
                    continue
                shapes = _SHAPE.findall(m.group(1))
                one = "{}[{}]".format(*shapes[0]) if m.group(2) and shapes else m.group(1)
                payload = _shape_bytes(one)
                if kind == "collective-permute":
                    listed = line.split("source_target_pairs=", 1)[-1].split("}}", 1)[0] + "}"
                    pairs = len(re.findall(r"\{\d+,\d+\}", listed))
                    sent = payload * pairs
                    largest_permute = max(largest_permute, payload)
                else:
                    n = _group_size(line, devices)
                    groups = max(devices // n, 1)
                    share = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
                             "reduce-scatter": float(n - 1)}[kind]
                    sent = payload * share * n * groups
                by_kind[kind] += sent * n_runs
                break
    total = sum(by_kind.values())
    return {"total_bytes": total, "per_device_bytes": total / max(devices, 1), "by_kind": by_kind,
            "largest_permute_bytes": largest_permute}


def memory(compiled) -> dict[str, int]:
    """XLA's per-device figures of a compiled step, and `held_bytes`: what the device holds at once,
    its arguments, temporaries and the outputs not written over a donated argument."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(getattr(m, "alias_size_in_bytes", 0)),
    }
    out["held_bytes"] = out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"] - out["alias_bytes"]
    return out


class HeapAccount(NamedTuple):
    """XLA's temporaries of one compiled module, from its dump (`heap_account`): `heap`, the size of
    its preallocated temp allocation (`memory()`'s `temp_bytes`); `live_peak`, the most bytes of that
    allocation's values live at one point of the schedule (a slot shared by several values at once
    counted once); `at`, that point's instruction; `buffers`, the (name, bytes) live there, largest
    first. `heap - live_peak` is the heap's packing: bytes no live-set model can predict."""

    heap: int
    live_peak: int
    at: str
    buffers: tuple[tuple[str, int], ...]


_TEMP_VALUE = re.compile(r" value: <\d+ (.+?) @\d+> \(size=(\d+),offset=(\d+)\)")
_LIVE_RANGE = re.compile(r"\s+(\S+):(\d+)-(\d+)$")
_SEQUENCE = re.compile(r"\s+(\d+):(\S+)$")


def heap_account(assignment: str, live_ranges: str) -> HeapAccount:
    """`HeapAccount` of a module from the text of its `--xla_dump_to` files
    `*-buffer-assignment.txt` (the values of the 'preallocated-temp' allocation, each with its size
    and offset) and `*-live-range.txt` (each value's first and last instruction in the schedule,
    `BufferLiveRange`). Not that file's "Live ranges at N (peak)": it counts the parameters' values
    too, so it is neither the temporaries' peak nor the heap."""
    lines = assignment.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("allocation") and "preallocated-temp" in line)
    heap = int(re.search(r"size (\d+)", lines[start]).group(1))
    values = []
    for line in lines[start + 1:]:
        m = _TEMP_VALUE.match(line)
        if m is None:
            break
        name = m.group(1).replace(" (phi)", "")
        values.append((name if "{" in name else name + "{}", int(m.group(2)), int(m.group(3))))
    spans, order, section = {}, {}, None
    for line in live_ranges.splitlines():
        if line.strip().endswith(":") and not line.startswith("    "):
            section = line.strip()
            continue
        pattern = _LIVE_RANGE if section == "BufferLiveRange:" else _SEQUENCE if section == "InstructionSequence:" \
            else None
        m = pattern.match(line) if pattern is not None else None
        if m is not None and section == "BufferLiveRange:":
            spans[m.group(1)] = (int(m.group(2)), int(m.group(3)))
        elif m is not None:
            order[int(m.group(1))] = m.group(2)
    live = collections.defaultdict(dict)  # point -> {(offset, size): name}
    for name, size, offset in values:
        first, last = spans.get(name, (0, -1))
        for point in range(first, last + 1):
            live[point].setdefault((offset, size), name)
    if not live:
        return HeapAccount(heap, 0, "", ())
    point = max(live, key=lambda p: sum(size for _, size in live[p]))
    held = sorted(((name, size) for (_, size), name in live[point].items()), key=lambda b: -b[1])
    return HeapAccount(heap, sum(size for _, size in held), order.get(point, str(point)), tuple(held))


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
    out: dict[str, Any] = {"busy_fraction": float(table.busy_fraction()["devices"]),
                           "busy_fraction_lockstep": float(table.lockstep_busy_fraction())}
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
        lo, hi = table.steady  # steady state: a step's late traffic and the previous steps' all counted once
        steps = max((hi - lo) / max(table.period, 1), 1e-9)
        out["table_bytes_per_device_per_step"] = float(per_tick[lo:hi].sum() / max(table.workers, 1) / steps)
    return out


def _one_device_figures(method, sizes, per_step: int) -> dict[str, Any]:
    """A method without a time table (one device, plain backprop or local learning over the
    whole batch): every stage's output is held at once at the end of the forward pass."""
    whole = float(sum(sizes["activation_bytes"])) * max(per_step, 1)
    L = float(method.net.num_stages)
    return {"activation_total": {"peak": L, "mean": L / 2, "peak_bytes": whole, "mean_bytes": whole / 2,
                                 "device_peak_bytes": whole, "device_peak_bytes_mean": whole,
                                 "device_mean_bytes": whole / 2}}


def micro_batch(method, config, mesh) -> int:
    """Examples per micro-batch as the method runs them: its program's (the batch split over the
    data groups, then into the program's micro-batches per call: a ring worker's data group is
    its device, one micro-batch a call), else the config's micro-batches or workers."""
    from cdpjax.layouts import LAYOUTS

    program = method.program
    B = int(config.global_batch_size)
    if program is not None:
        return max(B // int(dict(mesh.shape).get("data", 1)) // program.microbatches, 1)
    per_step = config.microbatches if LAYOUTS[config.method].microbatches else (method.workers or 1)
    return max(B // max(per_step, 1), 1)


def program_sizes(method, micro: int, task=None) -> dict[str, list[float]]:
    """Per-stage bytes that price a program's `Size`s: parameters, model state, the heads', one
    micro-batch's stage inputs (stage 0's: the batch), kept residuals, labels and images. The
    residuals (what each stage's `jax.vjp` keeps for its backward) are traced for every method: a
    program that carries them holds them in its buffers, one that recomputes them holds one op's
    (`op_workspace`), and a method without a program sweeps the whole model's (`memory_model`)."""
    from cdpjax import tasks
    from cdpjax.methods.stage_ops import StageOps

    task = task or tasks.CLASSIFICATION
    net = method.net
    params, state = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    L = net.num_stages
    image = jax.ShapeDtypeStruct((micro, *net.input_shape), net.input_dtype)
    inputs = [image] + [jax.ShapeDtypeStruct(s, jnp.float32) for s in net.stage_output_shapes(micro)[:-1]]
    labels = jax.ShapeDtypeStruct((micro, *task.label_shape(tuple(net.input_shape))), jnp.dtype(task.label_dtype))
    out = {"param": [tree_bytes(p) for p in params], "model_state": [tree_bytes(s) for s in state],
           "input": [tree_bytes(x) for x in inputs], "label": [tree_bytes(labels)] * L,
           "image": [tree_bytes(image)] * L, "head_param": [0] * L, "head_state": [0] * L,
           "head_residual": [0] * L, "flag": [1] * L}  # a boolean
    # traced where the mesh's axes are bound (a cross-device BatchNorm reduces over `data`)
    bound = [("stage", 1), ("data", 1)]
    if method.heads is not None:
        head_params, head_state = jax.eval_shape(method.heads.init, jax.random.key(0))
        out["head_param"] = [tree_bytes(p) for p in head_params]
        out["head_state"] = [tree_bytes(s) for s in head_state]
        out["head_residual"] = head_residuals(method.heads, head_params, head_state, micro, labels, image, bound)
    shapes = StageOps(net, task=task).residual_shapes(
        params, state, inputs, labels, lambda probe: jax.make_jaxpr(lambda: probe(lambda t: t) or 0, axis_env=bound)())
    out["residual"] = [tree_bytes(r) for r in shapes]
    out["conv_transpose"] = conv_transposes(net, params, state, inputs, labels, task, bound)
    return {k: [float(x) for x in v] for k, v in out.items()}


def conv_transposes(net, params, state, inputs, labels, task, bound) -> list[int]:
    """Per stage, the bytes of the largest activation its backward's weight-gradient convolutions
    read (0 for a stage without one), from the traced backward's jaxpr: a `conv_general_dilated`
    of the pullback whose result has the shape of one of the stage's parameters is a kernel's
    gradient, and its left operand the forward's activation. XLA:CPU runs such a convolution on
    copies of its operands transposed to its kernel's layout (`transpose_copy_fusion`), held beside
    or in place of the residuals the trace declares (the trace also counts, per ReLU, a zero
    cotangent XLA never makes). One copy, the largest, counted where a backward runs brought
    resnet_tiny's rings at 2 devices, dp at 8 and the one-unit pipelines within 5% of XLA
    (`tests/test_plan.py`); the live sets differ in detail (a ring's first-stage backward branch held
    five transposed copies and a copy of its cotangent, cdp-zero's the five without that copy).
    `net`, `inputs`, `labels`: `program_sizes`'."""
    from cdpjax.lowering import equations
    from cdpjax.methods.stage_ops import StageOps

    ops = StageOps(net, task=task)
    found = []

    def largest(jaxpr, kernels) -> int:
        lhs = [eqn.invars[0].aval for eqn in equations(jaxpr)
               if eqn.primitive.name == "conv_general_dilated" and tuple(eqn.outvars[0].aval.shape) in kernels]
        return max((int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in lhs), default=0)

    def probe():
        zeros = lambda a: jnp.zeros(a.shape, a.dtype)  # noqa: E731
        for j in range(net.num_stages):
            p, s, x, y = jax.tree.map(zeros, (params[j], state[j], inputs[j], labels))
            out, pullback, _ = ops.vjp(j, p, s, x, y)
            seed = ops.seed(j, jnp.zeros(out.shape, out.dtype))
            kernels = {tuple(q.shape) for q in jax.tree.leaves(p)}
            found.append(largest(jax.make_jaxpr(pullback, axis_env=bound)(seed).jaxpr, kernels))
        return 0

    jax.make_jaxpr(probe, axis_env=bound)()
    return found


def head_residuals(heads, head_params, head_state, micro: int, labels, image, bound) -> list[int]:
    """Per module, the bytes its auxiliary head's `jax.vjp` keeps for one micro-batch of `micro`
    examples (what the local step holds between the head's forward and its backward, beside the
    module's own residuals): the pullback's leaves but the head's parameters and its input. The input
    is the module's output, which the op makes whatever its head keeps (`op_workspace` counts it); a
    head that keeps it (one that does not pool first: the MLP's greedy head, a `Dense` on the
    features) adds nothing for it: in XLA's buffer assignment (ppll, the MLP and resnet_tiny) the op
    writes it once, into the switch's result, and the head reads it there. 0 where no head."""
    found = []

    def probe():
        for j in range(heads.num_stages):
            if heads.heads[j] is None:
                found.append(0)
                continue
            zeros = lambda a: jnp.zeros(a.shape, a.dtype)  # noqa: E731
            p, s = jax.tree.map(zeros, (head_params[j], head_state[j]))
            features = jnp.zeros((micro, *heads.feature_shapes[j]), jnp.float32)
            y, images = zeros(labels), zeros(image)
            _, pullback, _ = jax.vjp(lambda p_, f_: heads.loss(j, p_, s, f_, y, images, True), p, features,
                                     has_aux=True)
            own = {id(q) for q in jax.tree.leaves(p)} | {id(features)}
            found.append(tree_bytes([a for a in jax.tree.leaves(pullback) if id(a) not in own]))
        return 0

    jax.make_jaxpr(probe, axis_env=bound)()
    return found


def _prepare(config, devices=None, built=None) -> dict:
    """Builds and compiles `config.method`'s train step; everything but its timing. `built`: what
    `cdpjax.setup.setup(config, devices)` returned, where the caller set it up already."""
    from cdpjax import setup

    dataset, mesh, method = built or setup.setup(config, devices)
    batch = setup.put_batch(dataset.train_batch(0, config.global_batch_size, config.seed, False), mesh,
                            method.input_sharding)
    state = method.init(jax.random.key(config.seed))
    t0 = time.perf_counter()
    print(f"cdpjax bench: compiling {config.method} ...", file=sys.stderr, flush=True)
    # Compiled as the trainer runs it, with the state donated: the new state is written over the old,
    # so what a device holds is XLA's arguments plus temporaries (`memory`'s `held_bytes`).
    with compilation.CompileWatch() as watch:
        compiled = jax.jit(method.train_step, donate_argnums=0).lower(state, batch).compile()
    print(f"cdpjax bench: compiled {config.method} in {watch.words()}", file=sys.stderr, flush=True)
    from cdpjax import tasks

    return {"config": config, "mesh": mesh, "method": method, "compiled": compiled, "state": state,
            "batch": batch, "compile_seconds": time.perf_counter() - t0, "task": tasks.resolve(config, dataset)}


def _record(run: dict, step_seconds: float) -> dict[str, Any]:
    from cdpjax.runlog import method_report

    config, mesh, method, compiled = run["config"], run["mesh"], run["method"], run["compiled"]
    table = method.table
    if table is None:  # a method that does not keep its table: laid out from its layout
        from cdpjax.speedup import table_for

        table = table_for(config, int(mesh.devices.size), method.net.num_stages)
    micro = micro_batch(method, config, mesh)
    sizes = stage_sizes(method.net, micro)
    priced = program_sizes(method, micro, run["task"])
    devices = int(mesh.devices.size)
    hlo = compiled.as_text()
    sent = traffic(hlo, devices)
    record = {
        "method": config.method,
        "devices": int(method.devices or devices),
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "stages": method.net.num_stages,
        "workers": method.workers,
        "dp_mp_devices": method.dp_mp_devices,
        "global_batch_size": config.global_batch_size,
        "micro_batch": micro,
        "compile_seconds": run["compile_seconds"],
        "step_seconds": step_seconds,
        "images_per_second": config.global_batch_size / step_seconds,
        "memory": memory(compiled),
        "collectives": collectives(hlo),
        # What the compiled step's collectives send, each as often as it runs (one call = one step;
        # a message the program sends only at some ticks is counted at every tick of its loop).
        "sent_bytes_hlo_per_device_per_step": sent["per_device_bytes"],
        "sent_bytes_per_device_per_step": sent["per_device_bytes"],
        "sent_bytes_by_kind": sent["by_kind"],
        "largest_permute_bytes": sent["largest_permute_bytes"],
        "param_bytes": int(sum(sizes["param_bytes"])),
        "stage_param_bytes": sizes["param_bytes"],
        "stage_activation_bytes": sizes["activation_bytes"],
        "largest_stage_param_bytes": int(max(sizes["param_bytes"])),
        **(table_figures(table, sizes) if table is not None else _one_device_figures(method, sizes, 1)),
        "report": method_report(method),
    }
    if run.get("timing_note"):
        record["timing_note"] = run["timing_note"]
    if method.program is not None:  # what the program sends: exactly the runtime's messages
        record.update(_program_sends(method.program, priced))
    from cdpjax import cost, optim

    record["cost"] = cost.step_cost(method, compiled, micro, optim.make(config), devices, run["task"])
    record["memory_model"] = memory_model(method, config, table, sizes, devices, priced)
    return record


def _program_sends(program, priced) -> dict[str, Any]:
    """Bytes the program's messages carry per call, per device (mean and busiest), beside what they
    would carry padded to the carrier's rows (every message as large as the largest of its kind
    at any stage, stage 0's input included: a carrier row holds them all)."""
    from cdpjax.program import Size

    real = program.sent_bytes(priced)
    padded = np.zeros(program.devices)
    for s in program.sends:
        size = Size(s.size.of, tuple((j,) for j in range(len(priced[s.size.of]))), True, s.size.count, s.size.parts)
        padded[s.src] += size.bytes(priced)
    return {"sent_bytes_per_device_per_step": float(real.mean()),
            "sent_bytes_max_device_per_step": float(real.max()),
            "sent_bytes_padded_per_device_per_step": float(padded.mean()),
            "largest_permute_bytes": program.largest_send(priced),
            "sends_per_tick_max": int(program.sends_per_tick().max()) if program.sends else 0}


def variant_config(base, spec: str):
    """The config that `spec` names: a method, or NAME@KEY=VALUE[@KEY=VALUE...], a variant of
    it with its own keys (e.g. `cdp-v2@residuals=carry`), on a copy of `base`."""
    from cdpjax import config as cfg_lib

    name, *variant = spec.split("@")
    for item in variant:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key:
            raise cfg_lib.ConfigError(f"--methods {spec!r}: each @ is followed by KEY=VALUE (e.g. "
                                      f"{name or 'METHOD'}@residuals=carry), not {item!r}")
        if key == "method":
            raise cfg_lib.ConfigError(f"--methods {spec!r}: a variant keeps its method ({name!r}); list "
                                      f"{item.split('=', 1)[1].strip()!r} as a method of its own")
    c = cfg_lib.ml_collections.ConfigDict(base.to_dict())
    c.method = name
    cfg_lib.apply_overrides(c, variant)
    return c


def bench_methods(configs, devices=None, warmup: int = 2, repeats: int = 5, built=None) -> list[dict[str, Any]]:
    """One record per config (its `method`): every step compiled first, then timed in `repeats`
    interleaved rounds (one step of each method per round; median per method), so that load
    on the machine falls on all methods alike. `devices`: one device list (or None) per config.
    Every config is set up (`cdpjax.setup.setup`: checked, its method built) before any compiles, so that
    a method that refuses its config fails at once, not after the others compiled; `built`: those
    set-ups, where the caller made them (`setup_all`)."""
    devices = devices or [None] * len(configs)
    built = built or setup_all(configs, devices)
    runs = [_prepare(c, d, b) for c, d, b in zip(configs, devices, built)]
    warned = set()
    for run in runs:
        warning = oversubscribed(run["mesh"])
        if warning:
            run["timing_note"] = warning
            if warning not in warned:  # once per device count, not once per method
                print(f"cdpjax bench: {warning}", file=sys.stderr, flush=True)
                warned.add(warning)
    for run in runs:
        for _ in range(warmup):
            run["state"], _ = run["compiled"](run["state"], run["batch"])
        jax.block_until_ready(run["state"])
    times = [[] for _ in runs]
    for _ in range(repeats):
        for run, ts in zip(runs, times):
            t0 = time.perf_counter()
            run["state"], out = run["compiled"](run["state"], run["batch"])
            jax.block_until_ready((run["state"], out))
            ts.append(time.perf_counter() - t0)
    return [_record(run, statistics.median(ts)) for run, ts in zip(runs, times)]


def setup_all(configs, devices=None) -> list:
    """`cdpjax.setup.setup` of each config ((dataset, mesh, method)): every check, nothing compiled."""
    from cdpjax import setup

    return [setup.setup(c, d) for c, d in zip(configs, devices or [None] * len(configs))]


def oversubscribed(mesh) -> str | None:
    """A warning when the mesh has more simulated CPU devices than the machine has cores: its step
    time then measures how the devices share the cores, not the method (None otherwise)."""
    devices = list(mesh.devices.flat)
    cores = os.cpu_count() or 1
    if devices and devices[0].platform == "cpu" and len(devices) > cores:
        return (f"{len(devices)} simulated CPU devices on {cores} cores: the step time measures how they share "
                f"the cores; compare times at {cores} devices or fewer (cost.flops does not move with load)")
    return None


def bench_method(config, devices=None, warmup: int = 2, repeats: int = 5) -> dict[str, Any]:
    """One record: compile, time, memory, collectives and table figures of `config.method`."""
    return bench_methods([config], [devices], warmup, repeats)[0]


# ------------------------------------------------------------ the memory model


def optimizer_ratio(config, net) -> float:
    """The optimizer state's bytes per parameter byte of `config`'s optimizer on `net` (abstract)."""
    from cdpjax import optim

    tx = optim.make(config)
    shapes = jax.eval_shape(lambda: net.init(jax.random.key(0)))[0]
    opt = [tree_bytes(jax.eval_shape(tx.init, p)) for p in shapes]
    return sum(opt) / max(sum(tree_bytes(p) for p in shapes), 1)


def memory_model(method, config, table, sizes: dict, devices: int, priced: dict | None = None,
                 opt_ratio: float | None = None) -> dict[str, Any]:
    """What one device must hold, in bytes, beside which `bench` prints XLA's figures.

    Between steps (XLA: arguments): parameters x stored versions, optimizer state, gradient
    buffers in flight, relayed parameters, activations in flight (kept inputs, cotangents,
    residuals, labels) and the device's slice of the batch (the global batch over the mesh's
    `data` axis: a pipeline's stage devices each hold their replica's whole slice). Within a step
    (XLA: temporaries): for a method with a lowered program, the peak of each category of the
    call's buffers its program declares (`cdpjax.program.Program`, padding included; the figure by
    category counts the carried state too, the total only what a category holds beyond its arguments:
    `_beyond_arguments`) plus one backward op's workspace (`op_workspace`) and, on a worker that holds
    every stage, what a tick makes before it lands (`tick_outputs`), or, where the stages are kept in
    pieces and gathered (`gathers_pieces`), the tick's gradients and their pieces (`piece_scatter`,
    in place of the declared gradient row); on the stage engine, the larger of
    its tick's two halves instead, the switch's or the messages' and update's (`stage_tick`); for dp
    and the one-device methods, the backward's
    sweep over the stages (`backward_sweep`, from the residuals `program_sizes` traces; local
    learning's backwards after every forward, `forward_first_sweep`), or dp's
    all-reduce of the gradient, out of place, if that holds more. Checked against XLA for every
    method in `tests/test_plan.py` (within 5%, or the recorded ratio and why). `opt_ratio`:
    `optimizer_ratio(config, method.net)`, where the caller has it."""
    if opt_ratio is None:
        opt_ratio = optimizer_ratio(config, method.net)
    image = int(np.prod(method.net.input_shape)) * 4
    batch = (config.global_batch_size * image + config.global_batch_size * 4) / _batch_shards(method, config, devices)
    if method.program is not None:
        between, within = _program_memory(method.program, priced, opt_ratio)
        within["workspace"] = op_workspace(method.program, priced)
        within["tick_outputs"] = tick_outputs(method.program, priced)
        within["total"] = within["beyond_arguments"] + within["workspace"] + within["tick_outputs"]
        if gathers_pieces(method.program):
            within.update(piece_scatter(method.program, priced))
            within["tick_outputs"] = 0.0
            within["total"] = (within["beyond_arguments"] - _beyond_arguments(method.program, "gradients", priced)
                               + within["workspace"] + within["scatter"])
        if holds_carrier_slots(method.program):
            within.update(stage_tick(method.program, priced, within["workspace"], opt_ratio))
    else:
        reduced = method.input_sharding is None and _batch_shards(method, config, devices) > 1
        between, within = _structural_memory(method, table, sizes, opt_ratio, reduced, priced)
    between["batch"] = batch
    between["total"] = sum(v for k, v in between.items() if k != "versions")
    return {"arguments": between, "temporaries": within}


def _batch_shards(method, config, devices: int) -> int:
    """How many pieces the global batch is cut into, one a device: the mesh's `data` axis where the
    trainer places the batch over it (the default), 1 for a method that takes it on one device."""
    from cdpjax.layouts import mesh_for
    from cdpjax.mesh import resolve_axes

    if method.input_sharding is not None:
        return 1
    return max(int(resolve_axes(mesh_for(config), devices).get("data", 1)), 1)


_IN_FLIGHT = ("activations", "cotangents", "residuals", "images", "labels")


def _program_memory(program, priced, opt_ratio) -> tuple[dict, dict]:
    args = program.arguments(priced)
    between = {"parameters": args.get("parameters", 0.0) + args.get("previous_parameters", 0.0),
               "versions": program.versions, "optimizer_state": args.get("optimizer_state", 0.0) * opt_ratio,
               "model_state": args.get("model_state", 0.0), "gradients_in_flight": args.get("gradients", 0.0),
               "relayed_parameters": args.get("relayed_parameters", 0.0),
               "activations_in_flight": sum(args.get(k, 0.0) for k in _IN_FLIGHT)}
    held = lambda holds: float(program.held(holds, priced).max())  # noqa: E731 - peak over the call's ticks
    within = {"gradients_in_flight": held("gradients"), "activations": sum(held(k) for k in _IN_FLIGHT),
              "reduced_gradients": held("reduced_gradients"),
              "updated_parameters": held("parameters") - float(program.held("parameters", priced)[0]),
              "beyond_arguments": sum(_beyond_arguments(program, k, priced)
                                      for k in ("gradients", "reduced_gradients", "parameters", *_IN_FLIGHT))}
    return between, within


def _beyond_arguments(program, holds: str, priced) -> float:
    """The most bytes of category `holds` a call holds over its ticks beyond the category's arguments:
    its between-step buffers are the step's donated state, which the call updates in place (XLA's
    buffer assignment aliases them to the outputs), so they are arguments only, never also temporaries."""
    held = program.held(holds, priced)
    return float(held.max() - held[0])


def _structural_memory(method, table, sizes, opt_ratio, reduced: bool, priced=None) -> tuple[dict, dict]:
    """dp and the one-device methods: every stage on every device. Within the step, the backward
    sweeps the stages from the last to the first: while stage j's backward runs, the residuals
    that stages 0..j's forwards kept for it (`jax.vjp`'s, traced by `program_sizes`: each layer's
    input and what its derivative reads, a stage's internal activations included) and the
    gradients of stages j..L-1 are held; the peak is the largest such moment (`backward_sweep`).
    Local learning (`local`: a method with heads and no program) has no such chain: its modules'
    backwards run after every forward, the first module's first (`forward_first_sweep`).
    `reduced`: the gradient is then all-reduced over devices, which XLA does out of place (the
    summed copy a second whole gradient, live with the first once the residuals are freed).
    Without `priced` residuals, each stage's output stands for them (the table's activations)."""
    heads = [0.0] * len(sizes["param_bytes"]) if priced is None else list(priced["head_param"])
    grads = [float(p) + h for p, h in zip(sizes["param_bytes"], heads)]  # local learning: its heads' too
    params = float(sum(grads))
    versions = int(method.stored_versions)
    state = 0.0 if priced is None else float(sum(priced["model_state"]) + sum(priced["head_state"]))
    between = {"parameters": params * versions, "versions": versions, "optimizer_state": params * opt_ratio,
               "model_state": state, "gradients_in_flight": 0.0, "relayed_parameters": 0.0,
               "activations_in_flight": 0.0}
    residuals = list(priced["residual"]) if priced is not None else list(sizes["activation_bytes"])
    workspace = None if priced is None else priced["conv_transpose"]
    if method.heads is not None and priced is not None:  # local learning: each module's loss its head's
        kept = [r + h for r, h in zip(residuals, priced["head_residual"])]
        sweep = forward_first_sweep(kept, grads, workspace)
    else:
        sweep = backward_sweep(residuals, grads, workspace)
    within = {"gradients_in_flight": params, "activations": float(sum(residuals)),
              "reduced_gradients": params if reduced else 0.0}
    within["total"] = max(sweep, 2 * params if reduced else 0.0)
    return between, within


def op_workspace(program, priced) -> float:
    """The most bytes a device's backward ops hold beyond the program's buffers: per unit, the
    forward residuals its backward recomputes (none where the program carries them: they are its
    buffers), its auxiliary heads' residuals (`head_residuals`; local learning's op runs the head's
    forward and backward too), on a device that runs one unit its convolutions' transposed copies
    (`conv_transposes`; not on a device of several units: added there, zbv, dualpipev, interleaved-1f1b
    and looped-bfs read 1.04-1.06 of XLA when `unit_rows` still counted a copy of the gradient sums;
    not re-read since), the parameter gradient it makes before adding it to the unit's sum
    (none where a call runs one micro-batch on a stage device, ppll's: that gradient is the sum, written
    in place), and a local-learning op's output (the next module's input, made before it is written
    into the carried activation; a local program declares no message buffers). On the stage engine
    that output is also the switch's result (`switch_rows`), where XLA writes it once: counted twice
    (without it ppll on resnet_tiny at 4 devices was 0.88, before the transposed copies were counted;
    not re-read since). A stage-engine
    device that holds several units (zbv, interleaved-1f1b...) runs each in its own branch of the
    tick's switch; one branch runs a tick and XLA lays the branches' buffers over one another (the
    peak's live set in its buffer assignment): its workspace is its largest unit's, the largest
    device's returned. A ring worker holds every stage and runs one op a tick: the largest
    unit's (its placement names one device)."""
    place = program.placement
    local = any(KINDS[k].forward and KINDS[k].backward for k in program.kinds)
    summed = program.microbatches > 1 or place.every_worker_holds_every_unit
    one_unit = place.every_worker_holds_every_unit or place.chunks == 1
    per_unit = []
    for stages in place.units:
        residuals = 0.0 if program.carries else sum(priced["residual"][j] for j in stages)
        residuals += sum(priced["head_residual"][j] for j in stages)
        residuals += max(priced["conv_transpose"][j] for j in stages) if one_unit else 0.0
        made = sum(priced["param"][j] for j in stages) if summed else 0.0
        after = stages[-1] + 1
        out = priced["input"][after] if local and after < len(priced["input"]) else 0.0
        per_unit.append(residuals + made + out)
    if place.every_worker_holds_every_unit:
        return float(max(per_unit, default=0.0))
    per_device = [max((per_unit[u] for u in place.of_device(d)), default=0.0) for d in range(place.devices)]
    return float(max(per_device, default=0.0))


def tick_outputs(program, priced) -> float:
    """What a worker that holds every stage (a ring's: `Placement.every_worker_holds_every_unit`; where
    the stages are kept in pieces, `piece_scatter` instead) makes in one tick before it lands in its
    carried state: the op's output (a forward's activation for
    the next stage, a backward's cotangent for the previous one) and the messages it receives at the
    tick's end (each a fresh buffer, a collective's result, added to or written into the carried state
    after). Neither is one of the program's buffers; the most bytes any device's tick makes. A stage
    engine declares its messages (`messages.act` / `messages.cot`), so 0 for it."""
    if not program.placement.every_worker_holds_every_unit:
        return 0.0
    inputs, last = priced["input"], len(priced["input"]) - 1
    made: dict[tuple[int, int], float] = {}
    for e in program.events:
        if isinstance(e, Compute):
            kind = KINDS[e.kind]
            out = max(inputs[e.stage + 1] if kind.forward and e.stage < last else 0.0,
                      inputs[e.stage] if kind.cotangent and e.stage > 0 else 0.0)
            made[e.tick, e.device] = max(made.get((e.tick, e.device), 0.0), out)
    received: dict[tuple[int, int], float] = {}
    for e in program.events:
        if isinstance(e, Receive):
            received[e.tick, e.dst] = received.get((e.tick, e.dst), 0.0) + e.size.bytes(priced)
    return float(max((made.get(k, 0.0) + received.get(k, 0.0) for k in set(made) | set(received)), default=0.0))


def gathers_pieces(program) -> bool:
    """Whether the program keeps each stage in pieces over its workers and gathers a stage before a
    visit (`Gather` events: cdp-zero's engine), which `piece_scatter` models."""
    return any(isinstance(e, Gather) for e in program.events)


def piece_scatter(program, priced) -> dict[str, float]:
    """What a tick of a program that keeps its stages in pieces (`gathers_pieces`) holds beside its
    busiest op's workspace, in place of `tick_outputs` and the declared gradient row: every gradient
    op of the tick as a whole-stage gradient on every device (one SPMD program: each worker's op is
    a branch every device runs, the idle worker's making zeros of the stage's size), kept to the
    tick's end where its pieces go out, and the gradient pieces the tick's permutes deliver: one
    buffer per route (dst - src mod N) and payload length on every device, a permute's result, not
    only on its receiver. The op's own gradient counts here and in its workspace: the second stands
    for its stage's parameters, unpacked from the relay row in the op's branch. The gather's pieces
    are landed before the ops: not beside them. The most bytes over the ticks. Read against XLA's
    live set (`heap_account`) of cdp-zero on the MLP and `resnet_tiny` at 2, 4 and 8 devices."""
    split, devices = program.split_backward, program.devices
    rows: dict[int, float] = collections.defaultdict(float)
    for e in program.events:
        if isinstance(e, Compute) and KINDS[e.kind].completes_gradient(split):
            rows[e.tick] += priced["param"][e.stage]
    pairs: dict[tuple, float] = collections.defaultdict(float)
    for e in program.events:
        if isinstance(e, Receive) and e.size.parts > 1 and e.what in ("partial", "sum"):
            pairs[e.tick, e.src, e.dst] += e.wire_bytes(priced)
    routes: dict[int, set] = collections.defaultdict(set)
    for (tick, src, dst), payload in pairs.items():
        routes[tick].add(((dst - src) % devices, payload))
    received = {tick: sum(payload for _, payload in kept) for tick, kept in routes.items()}
    ticks = set(rows) | set(received)
    best = max(ticks, key=lambda t: rows.get(t, 0.0) + received.get(t, 0.0), default=None)
    if best is None:
        return {"gradient_rows": 0.0, "gradient_pieces": 0.0, "scatter": 0.0}
    out = {"gradient_rows": float(rows.get(best, 0.0)), "gradient_pieces": float(received.get(best, 0.0))}
    out["scatter"] = out["gradient_rows"] + out["gradient_pieces"]
    return out


def stage_tick(program, priced, workspace: float, opt_ratio: float = 1.0) -> dict[str, float]:
    """A stage engine's temporaries as the two halves of its tick, which XLA does not hold at once
    (read from its buffer assignment's peak live set: gpipe, zb-h1 and interleaved-1f1b on
    resnet_tiny at 4 devices, peak inside the switch's backward branch; gpipe on the MLP, peak at
    the messages). Through the whole tick: the call's carried buffers beyond its arguments
    (`_beyond_arguments`: slots, the gradient sums, the micro-batch split), every boundary's
    message buffer (`messages.*`: the gated permute's zero start), the zero start of the loop that
    averages the gradient over `data` (half of `reduced_gradients`), and, per slotted buffer a
    message lands in, the row its delivery reads (`jnp.where` against the old row), all made before
    the switch; on a device of several units, its unit's parameter and optimizer-state rows for the
    update (`update_rows`). Then the larger of:
    - the switch (`switch_rows`, the parameter rows the lanes read, `unit_rows`, the zero gradient
      rows of a tick of several lanes, `zero_gradient_rows`, and the larger of the op's workspace,
      `op_workspace`, and the lanes' parameters split out of their rows, `lane_splits`: a branch of
      several lanes splits every lane's parameters at its start and frees them before an op's
      workspace is made);
    - after it, each boundary's received message (a permute's result, a second message buffer)
      beside the averaged gradient and the update's new row."""
    names = {b.name for b in program.buffers}
    messages = sum(program.buffer(n).size.bytes(priced) for n in names if n.startswith("messages."))
    reduced = _beyond_arguments(program, "reduced_gradients", priced)
    updated = _beyond_arguments(program, "parameters", priced)
    carried = sum(_beyond_arguments(program, k, priced) for k in ("gradients", *_IN_FLIGHT)) - messages
    row, slotted = _slotted(program, priced)
    switch, units = switch_rows(program, priced), unit_rows(program, priced)
    zeros, splits = zero_gradient_rows(program, priced), lane_splits(program, priced)
    out = {"carried": carried, "messages": messages, "deliveries": row * len(slotted),
           "update_rows": update_rows(program, priced, opt_ratio), "unit_rows": units, "switch_rows": switch,
           "zero_gradient_rows": zeros, "lane_splits": splits,
           "switch": switch + units + zeros + max(workspace, splits),
           "after_switch": messages + reduced / 2 + updated}
    whole = carried + messages + reduced / 2 + out["deliveries"] + out["update_rows"]
    out["total"] = whole + max(out["switch"], out["after_switch"])
    return out


def unit_rows(program, priced) -> float:
    """Parameter rows a stage engine's switch holds as new arrays (one carrier row each): per lane,
    the row its op reads where that is not the stored row itself, a device of several units
    (`Placement.chunks` > 1) reading its unit's row of a [units, width] array by index, or a program
    of two versions (`Program.versions`: cdp-mp) selecting the version the op reads; such a program
    also keeps each older version by a select its update makes, which XLA hoists to the tick's start
    (live through the switch: cdp-mp on the MLP at 8 devices read 0.94 of XLA without it, 1.03 with).
    The gradient sums such a device copies for the tick are the sums themselves (the copy replaces
    the loop's value in XLA's live ranges: interleaved-1f1b on the MLP and resnet_tiny at 2 devices,
    dualpipev on the MLP at 2 and 8), counted where `stage_tick` carries them, not here. 0 for one
    unit's one version (read in place)."""
    V = program.placement.chunks
    row = _parameter_row(program, priced)
    out = lanes(program) * row if V > 1 or program.versions > 1 else 0.0
    out += (program.versions - 1) * row
    return float(out)


def lane_splits(program, priced) -> float:
    """On a device of several units (`Placement.chunks` > 1), a tick of several lanes (dualpipev's)
    splits every lane's parameters out of its row at once at its branch's start (a copy each: three
    128 x 128 kernels at XLA's live peak of dualpipev on the MLP at 2, 4 and 8 devices, before any
    op's workspace is made); on resnet_tiny's, whose peak is a convolution's backward later in the
    branch, they are freed by then. `stage_tick` holds the larger of these and the op's workspace
    (`op_workspace`: one lane's op holds its own parameters beside its gradient only in turn). 0 on
    one lane."""
    if program.placement.chunks == 1 or lanes(program) == 1:
        return 0.0
    return float(lanes(program) * _parameter_row(program, priced))


def zero_gradient_rows(program, priced) -> float:
    """On a device of several units (`Placement.chunks` > 1), a tick's branch returns a gradient row
    from every lane some op of which completes a gradient (`stage_lanes`), zeros where the cell's
    op of that lane does not (a forward, a split backward's input half, an idle lane), each added
    into its unit's row of the [units, width] sums: XLA makes such a zero row as its own buffer, and
    a copy (dualpipev on the MLP at 2, 4 and 8 devices and on resnet_tiny at 2: a zero row and its
    copy for its three lanes, of which W's is the gradient). The op's own gradient is in its
    workspace (`op_workspace`): the rows of the other such lanes. Not on a device of one unit:
    cdp-mp's paired forwards (two lanes, one unit) hold no such row (XLA's heap on the MLP at 4
    devices is the model's without it to 0.2%). 0 on one lane."""
    if program.placement.chunks == 1:
        return 0.0
    making = sum(g for _, g in stage_lanes(program))
    return float(max(making - 1, 0) * _parameter_row(program, priced))


def stage_lanes(program) -> list[tuple[bool, bool]]:
    """Per lane of a stage engine's cells (`cdpjax.program.stage_axis.StageTicks.cells`, the lanes
    in the table's order), (whether some op of the lane runs a forward or sends a cotangent, whether
    some op of the lane completes a parameter gradient): what the lane's results carry in some
    branch. dualpipev's three lanes: F, B or W; B or W; W only."""
    from cdpjax.program.stage_axis import program_ticks

    cells = program_ticks(program).cells
    out = []
    for k in range(max((len(cell) for cell in cells), default=0)):
        kinds = [KINDS[cell[k][0]] for cell in cells if len(cell) > k]
        out.append((any(kind.forward or kind.cotangent for kind in kinds),
                    any(kind.completes_gradient(program.split_backward) for kind in kinds)))
    return out


def update_rows(program, priced, opt_ratio: float = 1.0) -> float:
    """The rows a device of several units (`Placement.chunks` > 1) reads out of its [units, width]
    parameter and optimizer-state arrays for its unit's update (one carrier row, and the optimizer
    state's `opt_ratio` of one): read at the tick's start and held to the update at its end, through
    the switch and after it (XLA's live ranges: interleaved-1f1b on the MLP and resnet_tiny at 2
    devices, dualpipev on the MLP at 2 and 8; counted in the switch only, interleaved-1f1b on the
    MLP at 2 devices read 1.05 of XLA, its switch's peak over by the gradient sums counted twice).
    0 on a device of one unit (its rows updated in place)."""
    if program.placement.chunks == 1:
        return 0.0
    return float(_parameter_row(program, priced) * (1 + opt_ratio))


def _parameter_row(program, priced) -> float:
    """The bytes of one carrier row of parameters (a row of the program's gradient buffer)."""
    grads = program.buffer("grads").size
    return grads.bytes(priced) / grads.count


def holds_carrier_slots(program) -> bool:
    """Whether the program keeps its activations in slots of carrier rows (a slotted buffer 'acts',
    the widest unit input wide; the ring's 'acts' is a buffer per stage): a tick that switches over
    units on such rows, which `stage_tick` models."""
    return "acts" in program.slots()


def lanes(program) -> int:
    """The most ops one device runs in one tick (its cell's lanes, `StageTicks.lanes`), from the
    `Compute` events: ops of one (kind, micro-batch, step) are one lane (a unit's stages run together)."""
    cells = collections.defaultdict(set)
    for e in program.events:
        if isinstance(e, Compute):
            cells[(e.tick, e.device)].add((e.kind, e.microbatch, e.lag))
    return max((len(ops) for ops in cells.values()), default=0)


def _slotted(program, priced) -> tuple[float, list[str]]:
    """(one carrier row's bytes, the slot buffers of more than one row: 'acts', 'cots')."""
    names = {b.name for b in program.buffers}
    act = program.buffer("acts").size
    slotted = [n for n in ("acts", "cots") if n in names and program.buffer(n).size.count > 1]
    return act.bytes(priced) / act.count, slotted


def switch_rows(program, priced) -> float:
    """What a stage engine's tick holds around its `lax.switch` beyond the program's buffers: every
    lane's operands are made before the switch, whichever branch runs (one SPMD program), and its
    results after it. Per lane (`StageTicks.lanes`): its input row and, where the program keeps
    cotangents in slots, its cotangent row, each read out of a buffer of more than one slot (a copy;
    a one-slot buffer is read in place) and held in two shapes (the branches take the row as
    [1, B, width] and as [B, width]); its results, an output row and, where the program sends
    cotangents, a cotangent row, where some op of the lane makes either (`stage_lanes`: XLA drops
    the rows of a lane no branch writes, dualpipev's W-only lane). A row is a carrier row
    (`Size.padded`: the widest unit input)."""
    row, slotted = _slotted(program, priced)
    results = row * (2 if "cots" in {b.name for b in program.buffers} else 1)
    writing = sum(w for w, _ in stage_lanes(program))
    return float(lanes(program) * 2 * row * len(slotted) + writing * results)


def backward_sweep(residuals: Sequence[float], grads: Sequence[float],
                   workspace: Sequence[float] | None = None) -> float:
    """The most bytes a backward from the last stage to the first holds at once: at stage j's
    backward, the residuals of stages 0..j (not yet read), the gradients of stages j..L-1 and
    stage j's own backward workspace (`workspace[j]`, `conv_transposes`; none where not given)."""
    extra = _per_stage(workspace, len(residuals))
    return float(max((sum(residuals[:j + 1]) + extra[j] + sum(grads[j:]) for j in range(len(residuals))), default=0.0))


def forward_first_sweep(residuals: Sequence[float], grads: Sequence[float],
                        workspace: Sequence[float] | None = None) -> float:
    """The most bytes local learning's one-device step (`local`) holds at once. No gradient crosses
    a module boundary, so module j's backward waits for nothing but its own forward, and XLA runs
    every module's forward, its head's loss included, before the first backward, then the backwards
    from the first module to the last, each module's update right after its backward (read from the
    live ranges of its buffer assignment: the MLP and resnet_tiny at 2 devices; resnet_tiny's peak
    is the first module's backward beside every later module's conv outputs, 0.92 of XLA on
    `backward_sweep`, which holds only stages 0..j's). At module j's backward: the residuals of
    modules j..L-1 (`residuals[j]`: the body's and its head's, not yet read), module j's backward
    workspace (`workspace[j]`, `conv_transposes`; none where not given) and its gradient (`grads[j]`:
    the body's and its head's)."""
    extra = _per_stage(workspace, len(residuals))
    return float(max((sum(residuals[j:]) + extra[j] + grads[j] for j in range(len(residuals))), default=0.0))


def _per_stage(workspace: Sequence[float] | None, stages: int) -> list[float]:
    """A sweep's per-stage workspace: as given, or none."""
    return list(workspace) if workspace is not None else [0.0] * stages


def format_table(records: list[dict]) -> str:
    """A readable table with ratios to the first method."""
    if not records:
        return ""
    base = records[0]
    head = ["method", "devices", "compile s", "step s", "x first", "img/s", "temp MiB", "args MiB",
            "model temp", "model args", "busy", "busy lockstep", "act peak", "act peak MiB", "comm bal",
            "sent MiB/dev/step", "all-reduce MiB", "largest permute MiB"]
    rows = []
    for r in records:
        mem = r.get("memory", {})
        coll = r.get("collectives", {})
        act = r.get("activation_total", {})
        model = r.get("memory_model", {})
        rows.append([
            r.get("label", r["method"]), str(r["devices"]), f"{r['compile_seconds']:.1f}", f"{r['step_seconds']:.4f}",
            f"{r['step_seconds'] / base['step_seconds']:.2f}", f"{r['images_per_second']:.0f}",
            f"{mem.get('temp_bytes', 0) / 2**20:.2f}", f"{mem.get('argument_bytes', 0) / 2**20:.2f}",
            _mib(model.get("temporaries", {}).get("total")), _mib(model.get("arguments", {}).get("total")),
            f"{r['busy_fraction']:.2f}" if "busy_fraction" in r else "-",
            f"{r['busy_fraction_lockstep']:.2f}" if "busy_fraction_lockstep" in r else "-",
            f"{act['peak']:.1f}" if act else "-",
            _mib(act.get("device_peak_bytes")) if act else "-",
            f"{r['comm_balance']:.2f}" if "comm_balance" in r else "-",
            _mib(r.get("sent_bytes_per_device_per_step")),
            f"{coll.get('all-reduce', {}).get('max_bytes', 0) / 2**20:.3f}",
            f"{r.get('largest_permute_bytes', 0) / 2**20:.3f}",
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    notes = [_layout_note(r) for r in records]
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows), *filter(None, notes)])


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def _layout_note(record: dict) -> str:
    """A line for a method on a uniform stage carrier: its padding, and its device count against
    the N*L devices that DP with model parallelism needs for the same workers and stages."""
    padding = record.get("report", {}).get("padding")
    if not isinstance(padding, dict):
        return ""
    ratios = ", ".join(f"{k} x{v:.2f}" for k, v in padding.items() if isinstance(v, float))
    note = f"{record['method']}: padding (stored/real) {ratios}"
    if record.get("dp_mp_devices"):
        note += (f"; {record['devices']} devices for N={record.get('workers')} workers x L={record['stages']} "
                 f"stages, where DP with model parallelism needs {record['dp_mp_devices']}")
    return note
