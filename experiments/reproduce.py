"""Reproduces the papers' tables and figures from the configs in cdpjax/configs/.

    python experiments/reproduce.py cdp-table --tiny     # digits: every row runs here, on 2 cores
    python experiments/reproduce.py ppll-table --tiny
    python experiments/reproduce.py all --tiny --out out/tiny
    python experiments/reproduce.py all                  # the papers' configs: GPUs, prepared datasets

Every row is one training run (`cdpjax.train.train`) into OUT/<row>/ and one
`cdpjax.bench.bench_method` record of the same config (memory per device, the
collectives of the compiled step, throughput); pipeline rows also get the
speedup that `cdpjax.speedup` predicts on K devices. A row's results are cached
in OUT/<row>/ (summary.json, bench.json, prediction.json, row.json), so a
rerun reuses finished rows and an interrupted run resumes from its last
checkpoint. Rows of methods that are not registered, and rows that cannot run
here (a dataset not prepared, too few devices), stay in the table with a note
instead of numbers. `--config.KEY=VALUE` overrides every row's config (e.g.
`--config.cdp_impl=simulate --config.mesh.data=1` for the CDP rows on one GPU).

Tables (OUT/cdp_table.md, OUT/ppll_table.md):
- CDP: dataset x model x {dp, cdp-v1, cdp-v2}: test accuracy; activation memory
  from the method's time table (stage-activations held by all workers together
  in steady state, peak and mean, and the peak in bytes for this model);
  communication from the table (busiest tick's gradient bytes over the mean
  tick's) and from the compiled step's HLO (all-reduce and collective-permute
  bytes, each op counted once even inside a loop); temporaries per device.
- PPLL: model x K x {e2e, local, ppll, gpipe}: test accuracy; time per epoch
  and speed relative to `local` as measured here (bench's median step); the
  speedup on K devices that `cdpjax.speedup` predicts from per-stage times
  measured on one device; memory per device (temporaries + arguments).

Figures (OUT/figures/): cdp_accuracy_<dataset>_<model>.png (test accuracy and
train loss over steps from metrics.jsonl), cdp_activation_<dataset>_<model>.png,
cdp_comm_<dataset>_<model>.png (from the time tables), ppll_speedup_<model>.png,
ppll_accuracy_<model>.png.

Times measured on simulated CPU devices share the same cores: the measured
ratios show the framework's overhead, not the speedup of real devices
(docs/design.md, "What is measured"); the predicted column is the one to read for that.
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import sys
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))

CDP_METHODS = ("dp", "cdp-v1", "cdp-v2")
# The PPLL rows of each K: (method, label, config overrides). PPLL's own "conventional pipeline" is
# plain model parallelism (GPipe with one micro-batch); GPipe with M = 4 is the stronger baseline.
PPLL_VARIANTS = (
    ("local", "local", ()),
    ("ppll", "ppll", ()),
    ("gpipe", "gpipe M=1 (plain model parallelism)", ("microbatches=1",)),
    ("gpipe", "gpipe M=4", ("microbatches=4",)),
)
# Head and recipe variants of local learning, each run as local and ppll and read against its own
# local row: (variant, config-file arguments, config overrides). Tiny: the heads of issue 17 on the
# digits MLP at K = 4 (PPLL's momentum heads, InfoPro's 2c2f, InfoPro's contrastive loss); paper
# configs: InfoPro's recipe beside PPLL's (cdpjax/configs/ppll_resnet32.py).
PPLL_HEAD_VARIANTS = (
    ("man", "", ("aux_head=man",)),
    ("infopro 2c2f", "", ("aux_head=infopro", "aux_kwargs.arch=2c2f")),
    ("infopro contrast", "", ("aux_head=infopro", "aux_kwargs.loss=contrast", "aux_kwargs.feature_dim=128")),
)
PPLL_RECIPE_VARIANTS = (("InfoPro's recipe", "recipe=infopro", ()),)
# PPLL's ViT on 2 GPUs (configs/k2_vit_224_p16.yaml): the same 12 modules grouped [5, 7], local and ppll.
PPLL_VIT_VARIANTS = (("2 devices", "devices=2", ()),)
PIPELINES = ("ppll", "gpipe")
TINY_STEPS = 600  # what cdpjax/configs/digits.py documents its expectations for
BENCH_REPEATS = {True: 20, False: 10}  # timed steps per bench record (tiny, full): medians of many


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a table: `method` trained from `config` ("FILE.py:ARGS" in cdpjax/configs)."""

    table: str  # 'cdp' | 'ppll'
    name: str  # its directory under OUT
    group: tuple  # cdp: (dataset, model); ppll: (model, K), K None for e2e
    method: str
    config: str
    label: str = ""  # what the table calls it (default: the method)
    overrides: tuple = ()  # KEY=VALUE applied to the config: what makes the row this variant
    variant: str = ""  # local learning's head or recipe variant: its rows are read against its own local row


def cdp_rows(tiny: bool) -> list[Row]:
    if tiny:
        groups = [("digits", "mlp", "digits.py:method={method}")]
    else:
        groups = [(dataset, model, f"{file}:model={model},method={{method}}")
                  for dataset, file in (("cifar10", "cdp_cifar10.py"), ("imagenet2012", "cdp_imagenet.py"))
                  for model in ("resnet18", "resnet50")]
    return [Row("cdp", f"cdp-{dataset}-{model}-{method}", (dataset, model), method, spec.format(method=method))
            for dataset, model, spec in groups for method in CDP_METHODS]


def ppll_rows(tiny: bool) -> list[Row]:
    if tiny:  # model, the K of its rows, the K of its variants' rows, the config, the variants
        groups = [("mlp", (2, 4), (4,), "digits.py:method={method},stages={K}", PPLL_HEAD_VARIANTS)]
    else:
        groups = [("resnet32", (2, 4, 8, 16), (2, 4, 8, 16), "ppll_resnet32.py:K={K},method={method}",
                   PPLL_RECIPE_VARIANTS),
                  # PPLL's ViT: 12 one-block modules, [2, 3, 3, 4] on 4 devices (ppll_vit.py's default
                  # devices), and [5, 7] on 2 as a variant read against its own local row
                  ("vit", (12,), (12,), "ppll_vit.py:K={K},method={method}", PPLL_VIT_VARIANTS)]
    rows = []
    for model, ks, variant_ks, spec, variants in groups:
        # e2e does not depend on K: one row per model.
        rows.append(Row("ppll", f"ppll-{model}-e2e", (model, None), "e2e", spec.format(method="e2e", K=ks[-1])))
        for K in ks:
            for method, label, overrides in PPLL_VARIANTS:
                suffix = "".join(f"-{o.split('=')[0][:1].upper()}{o.split('=')[1]}" for o in overrides)
                rows.append(Row("ppll", f"ppll-{model}-K{K}-{method}{suffix}", (model, K), method,
                                spec.format(method=method, K=K), label, overrides))
            if K not in variant_ks:
                continue
            for variant, args, overrides in variants:
                slug = variant.replace("'s", "").replace(" ", "-").lower()
                for method in ("local", "ppll"):
                    config = spec.format(method=method, K=K) + (f",{args}" if args else "")
                    rows.append(Row("ppll", f"ppll-{model}-K{K}-{method}-{slug}", (model, K), method, config,
                                    f"{method} ({variant})", overrides, variant))
    return rows


# ------------------------------------------------------------------ configs


def shorten(config, steps: int) -> None:
    """`steps` training steps, with the schedule's step counts scaled to match
    (warm-up, decay interval, evaluation and checkpoint intervals)."""
    scale = steps / config.num_steps
    config.warmup_steps = min(int(config.warmup_steps * scale), max(steps - 1, 0))
    if config.decay_every:
        config.decay_every = max(1, min(int(config.decay_every * scale), steps))
    config.eval_every = max(1, steps // 10)  # ten points on the accuracy curve
    config.checkpoint_every = max(1, steps // 2) if config.checkpoint_every else 0
    config.log_every = max(1, min(config.log_every, steps // 20 or 1))
    config.num_steps = steps


def row_config(row: Row, steps: int | None, overrides=()):
    from cdpjax import config as cfg_lib

    config = cfg_lib.load_file(os.path.join(cfg_lib.CONFIGS_DIR, row.config))
    if steps is not None:
        shorten(config, steps)
    cfg_lib.apply_overrides(config, overrides)
    cfg_lib.apply_overrides(config, row.overrides)  # last: they make the row what it is
    return config


def devices_for(config) -> list:
    """The first prod(mesh) devices (pipeline configs name a `stage` axis of K devices),
    or every device when an axis is -1."""
    import jax

    from cdpjax.errors import ConfigError

    from cdpjax.layouts import devices_needed, mesh_for

    available = jax.devices()
    needed = devices_needed(config)
    if needed is None:
        return available
    if needed > len(available):
        raise ConfigError(f"needs {needed} devices (mesh {mesh_for(config)}), {len(available)} here")
    return available[:needed]


# --------------------------------------------------------------------- rows


def _cached(path: str, compute: Callable[[], Any]) -> Any:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    value = compute()
    with open(path, "w") as f:
        json.dump(value, f, indent=2, default=_jsonable)
    with open(path) as f:  # what a resumed run will read
        return json.load(f)


def _jsonable(x):
    return x.tolist() if hasattr(x, "tolist") else str(x)


def run_row(row: Row, out: str, steps: int | None, overrides=(), bandwidth: float = 100e9,
            repeats: int = 5, log: Callable[[str], None] = print) -> dict:
    """Trains, benches and (pipelines) predicts one row; returns its record, cached in OUT/<row>/row.json.

    A record has `status` 'ok', 'not registered' or 'skipped' (with `note`)."""
    from cdpjax import methods
    from cdpjax.errors import ConfigError

    record = {"table": row.table, "name": row.name, "group": list(row.group), "method": row.method,
              "config": row.config, "label": row.label or row.method, "overrides": list(row.overrides),
              "variant": row.variant}
    if row.method not in methods.REGISTRY:
        return {**record, "status": "not registered", "note": "not registered"}
    workdir = os.path.join(out, row.name)
    cached = os.path.join(workdir, "row.json")
    if os.path.exists(cached):
        with open(cached) as f:
            done = json.load(f)
        if steps is None or done["summary"]["steps"] == steps:
            log(f"{row.name}: reusing {cached}")
            return done
        raise ConfigError(f"{workdir} holds a {done['summary']['steps']}-step run, not {steps}: "
                          f"choose another --out or remove it")
    try:
        config = row_config(row, steps, overrides)
        devices = devices_for(config)
        os.makedirs(workdir, exist_ok=True)
        from cdpjax import bench, train

        summary = _cached(os.path.join(workdir, "summary.json"),
                          lambda: train.train(config, workdir, progress=False, devices=devices))
        if summary["steps"] != config.num_steps:
            raise ConfigError(f"{workdir} holds a {summary['steps']}-step run, not {config.num_steps}: "
                              f"choose another --out or remove it")
        measured = _cached(os.path.join(workdir, "bench.json"),
                           lambda: bench.bench_method(config, devices, repeats=repeats))
        record.update(status="ok", summary=summary, bench=measured, **_figures(row, config, summary))
        if row.method in PIPELINES:
            from cdpjax import speedup

            record["prediction"] = _cached(
                os.path.join(workdir, "prediction.json"),
                lambda: speedup.predict_for_config(config, len(devices), bandwidth))
    except ConfigError as e:  # cannot run here: the table says why, the other rows go on
        log(f"{row.name}: skipped: {e}")
        return {**record, "status": "skipped", "note": str(e)}
    with open(cached, "w") as f:
        json.dump(record, f, indent=2, default=_jsonable)
    return record


def _figures(row: Row, config, summary: dict) -> dict:
    """What the row's tables and plots need beyond the summary and the bench record."""
    from cdpjax import bench, data, models
    from cdpjax.layouts.cdp import cdp_table

    dataset = data.build(config)
    out = {"num_train": dataset.num_train}
    if row.table != "cdp":
        return out
    workers = int(summary.get("workers") or summary["mesh"].get("data", 1))
    stages = int(summary["stages"])
    net = models.build(config, dataset.image_shape, dataset.num_classes)
    sizes = bench.stage_sizes(net, max(config.global_batch_size // workers, 1))
    table = cdp_table(row.method, workers, stages, steps=4)
    per_tick = table.bytes_per_tick(sizes["param_bytes"])
    lo, hi = table.steady
    out.update(workers=workers, stages=stages, stage_param_bytes=sizes["param_bytes"],
               stage_activation_bytes=sizes["activation_bytes"],
               activation=table.activation_stats(sizes["activation_bytes"]),
               comm_balance=table.comm_balance(sizes["param_bytes"]),
               comm_peak_tick_bytes=float(per_tick[lo:hi].max()) if hi > lo else 0.0)
    return out


# ------------------------------------------------------------------- tables


def _bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


CDP_HEAD = ["dataset", "model", "method", "N x L", "steps", "test acc", "act. peak / mean (stage-acts)",
            "act. peak bytes, all / device", "comm busiest / mean tick", "busiest tick", "sent / worker / step",
            "HLO all-reduce", "HLO permute", "temp / args per device"]


def cdp_markdown(records: list[dict]) -> str:
    rows = []
    for r in records:
        dataset, model = r["group"]
        if r["status"] != "ok":
            rows.append([dataset, model, r["method"], "-", "-", r["note"]] + ["-"] * (len(CDP_HEAD) - 6))
            continue
        act, coll, mem = r["activation"], r["bench"]["collectives"], r["bench"]["memory"]
        sent = r["bench"].get("sent_bytes_per_device_per_step")
        rows.append([
            dataset, model, r["method"], f"{r['workers']} x {r['stages']}", str(r["summary"]["steps"]),
            f"{100 * r['summary']['test_accuracy']:.1f}%",
            f"{act['total_peak']} / {act['total_mean']:.1f}",
            f"{_bytes(act.get('total_peak_bytes'))} / {_bytes(act.get('device_peak_bytes'))}",
            f"{r['comm_balance']:.2f}", _bytes(r["comm_peak_tick_bytes"]), _bytes(sent) if sent is not None else "-",
            _bytes(coll["all-reduce"]["bytes"]), _bytes(coll["collective-permute"]["bytes"]),
            f"{_bytes(mem.get('temp_bytes'))} / {_bytes(mem.get('argument_bytes'))}",
        ])
    notes = [
        "act.: stage-activations (one stage's output for one micro-batch) held by all workers together, "
        "steady state of the time table (the unit model); bytes: the same with each stage's real output "
        "bytes, over all workers and on the busiest device.",
        "comm: gradient bytes sent per tick from the time table (1.00 = flat; dp sends one all-reduce "
        "burst per step); sent: bytes the compiled step really sends per worker per step (each transfer "
        "as often as it runs); HLO: result bytes of the compiled step's collectives, each op counted once.",
        "temp / args per device: temporaries and arguments of the compiled step on one device, the state "
        "donated (XLA memory analysis).",
    ]
    return _markdown(CDP_HEAD, rows) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


PPLL_HEAD = ["model", "K", "method", "devices", "steps", "test acc", "speed, x local (here)",
             "predicted speedup on K devices", "memory / device", "x local's memory"]


def _reference(record: dict) -> tuple:
    """The key of the local row a row is read against: its group and its head or recipe variant."""
    return (*record["group"], record.get("variant", ""))


def _local_speed(records: list[dict]) -> dict:
    return {_reference(r): r["bench"]["images_per_second"] for r in records
            if r["status"] == "ok" and r["method"] == "local"}


def _device_memory(record: dict) -> int:
    """What one device holds of the compiled step: arguments + temporaries, the state donated (XLA's
    memory analysis, `cdpjax.bench.memory`)."""
    mem = record["bench"]["memory"]
    return mem.get("held_bytes", 0) if mem else 0


def ppll_markdown(records: list[dict]) -> str:
    local = _local_speed(records)
    local_memory = {_reference(r): _device_memory(r) for r in records
                    if r["status"] == "ok" and r["method"] == "local"}
    rows = []
    for r in records:
        model, K = r["group"]
        k = "-" if K is None else str(K)
        label = r.get("label") or r["method"]
        if r["status"] != "ok":
            rows.append([model, k, label, "-", "-", r["note"]] + ["-"] * (len(PPLL_HEAD) - 6))
            continue
        ips = r["bench"]["images_per_second"]
        ref = local.get(_reference(r))
        pred = r.get("prediction", {})
        memory, ref_memory = _device_memory(r), local_memory.get(_reference(r))
        rows.append([
            model, k, label, str(r["bench"]["devices"]), str(r["summary"]["steps"]),
            f"{100 * r['summary']['test_accuracy']:.1f}%",
            f"{ips / ref:.2f}" if ref else "-",
            f"{pred['speedup']:.2f}x" if "speedup" in pred else pred.get("error", "-"),
            _bytes(memory) if memory else "-",
            f"{memory / ref_memory:.2f}" if memory and ref_memory else "-",
        ])
    notes = [
        "speed, x local: images per second over local's (bench's median step time here, side by side in one "
        "process; absolute times are in each row's row.json); on "
        "simulated CPU devices sharing the same cores these show the framework's overhead, not a speedup.",
        "predicted speedup: `cdpjax.speedup` replays the method's time table on K devices with per-stage "
        "times measured on one device, auxiliary heads' forward and backward included for ppll; against "
        "the same work on one device (ppll: local learning; gpipe: end-to-end backprop), steady state.",
        "baselines: gpipe M=1 is plain model parallelism, the \"conventional pipeline\" PPLL's paper compares "
        "against; gpipe M=4 cuts each batch into 4 micro-batches (GPipe).",
        "memory / device: temporaries + arguments of the compiled step on one device, the state donated "
        "(XLA memory analysis); "
        "x local's memory: over `local` on one device (PPLL's paper: about 0.9).",
        "variants in brackets (heads, recipes): local and ppll with that head or recipe; speed and memory "
        "against the local row of the same variant. InfoPro's recipe runs InfoPro's 160 epochs with its "
        "reflect-padded CIFAR-10 crops (cdpjax/configs/ppll_resnet32.py).",
        "vit: K = 12 one-block modules, grouped [2, 3, 3, 4] on 4 devices for local and ppll, and 4 stages of "
        "those blocks for gpipe; local and ppll (2 devices): the same modules grouped [5, 7] on 2 devices, as "
        "PPLL's 2-GPU runs (configs/k2_vit_224_p16.yaml); the last module's block trains on its own head and "
        "the classifier on the block's detached output, as released; every row runs the recipe's 50 epochs "
        "(equal work), where the "
        "released end-to-end script ran 400 and the pipeline baseline 200 (cdpjax/configs/ppll_vit.py).",
    ]
    return _markdown(PPLL_HEAD, rows) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


# ------------------------------------------------------------------ figures


def _figure(width: float, height: float, panels: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, [fig.add_subplot(1, panels, i + 1) for i in range(panels)]


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, bbox_inches="tight", dpi=120)
    return path


def read_metrics(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_accuracy(records: list[dict], out: str, path: str) -> str:
    """Test accuracy and train loss over steps, one line per method."""
    fig, (acc, loss) = _figure(10.0, 3.4, 2)
    for r in records:
        metrics = read_metrics(os.path.join(out, r["name"]))
        test = [m for m in metrics if m["split"] == "test"]
        train = [m for m in metrics if m["split"] == "train"]
        acc.plot([m["step"] for m in test], [m["accuracy"] for m in test], marker="o", markersize=3,
                 label=r["method"])
        loss.plot([m["step"] for m in train], [m["loss"] for m in train], label=r["method"])
    acc.set(xlabel="step", ylabel="test accuracy", title="test accuracy")
    loss.set(xlabel="step", ylabel="train loss", yscale="log", title="train loss")
    for ax in (acc, loss):
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_activation_bytes(tables, stage_bytes, path: str) -> str:
    """Activation bytes held by all workers over ticks (each stage's real output bytes), one line per table."""
    import numpy as np

    fig, (ax,) = _figure(5.5, 3.2)
    for t in tables:
        held = t.activation_bytes(stage_bytes).sum(1) / 2**20
        ax.step(np.arange(len(held)), held, where="post", label=f"{t.method} (peak {held.max():.2f} MiB)")
    ax.set(xlabel="time step (tick)", ylabel="activations held, all workers (MiB)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def cdp_figures(records: list[dict], out: str) -> list[str]:
    from cdpjax import plotting
    from cdpjax.layouts.cdp import cdp_table

    paths = []
    groups = {}
    for r in records:
        if r["status"] == "ok":
            groups.setdefault(tuple(r["group"]), []).append(r)
    for (dataset, model), rs in groups.items():
        stem = os.path.join(out, "figures", f"{{}}_{dataset}_{model}.png")
        paths.append(plot_accuracy(rs, out, stem.format("cdp_accuracy")))
        N, L = rs[0]["workers"], rs[0]["stages"]
        # cdp-v1 and cdp-v2 share one timing (they differ in the versions read): one cdp line.
        tables = [cdp_table(m, N, L, steps=4) for m in ("dp", "cdp-v2")]
        paths.append(plotting.plot_activation(tables, stem.format("cdp_activation")))
        paths.append(plot_activation_bytes(tables, rs[0]["stage_activation_bytes"],
                                           stem.format("cdp_activation_bytes")))
        paths.append(plotting.plot_comm(tables, rs[0]["stage_param_bytes"], stem.format("cdp_comm")))
    return paths


def ppll_figures(records: list[dict], out: str) -> list[str]:
    """Per model: speedup over K (predicted on K devices; measured here against local) and accuracy."""
    import numpy as np

    local = _local_speed(records)
    paths = []
    for model in dict.fromkeys(r["group"][0] for r in records):
        rs = [r for r in records if r["group"][0] == model and r["status"] == "ok"]
        if not rs:
            continue
        ks = sorted({r["group"][1] for r in rs if r["group"][1] is not None})
        fig, (ax,) = _figure(5.5, 3.4)
        labels = [label for method, label, _ in PPLL_VARIANTS if method in PIPELINES]
        for label in labels:
            pred = [(r["group"][1], r["prediction"]["speedup"]) for r in rs
                    if r.get("label") == label and "speedup" in r.get("prediction", {})]
            here = [(r["group"][1], r["bench"]["images_per_second"] / local[_reference(r)]) for r in rs
                    if r.get("label") == label and _reference(r) in local]
            if pred:
                ax.plot(*zip(*pred), marker="o", label=f"{label}, predicted on K devices")
            if here:
                ax.plot(*zip(*here), marker="x", linestyle="--", label=f"{label} / local, measured here")
        if ks:
            ax.plot(ks, ks, color="grey", linewidth=0.8, label="K (no bubble, free transfers)")
        ax.set(xlabel="K (stages = devices)", ylabel="speedup", title=f"{model}: speedup", xticks=ks)
        ax.legend(fontsize=7)
        paths.append(_save(fig, os.path.join(out, "figures", f"ppll_speedup_{model}.png")))

        fig, (ax,) = _figure(5.5, 3.4)
        labels = [label for _, label, _ in PPLL_VARIANTS if any(r.get("label") == label for r in rs)]
        width = 0.8 / max(len(labels), 1)
        for n, label in enumerate(labels):
            acc = {r["group"][1]: r["summary"]["test_accuracy"] for r in rs if r.get("label") == label}
            ax.bar(np.arange(len(ks)) + (n - (len(labels) - 1) / 2) * width,
                   [acc.get(k, np.nan) for k in ks], width, label=label)
        for r in rs:
            if r["method"] == "e2e":
                ax.axhline(r["summary"]["test_accuracy"], color="black", linestyle="--", label="e2e")
        ax.set(xlabel="K", ylabel="test accuracy", title=f"{model}: accuracy", xticks=range(len(ks)),
               xticklabels=[str(k) for k in ks])
        lows = [r["summary"]["test_accuracy"] for r in rs]
        ax.set_ylim(max(0.0, min(lows) - 0.1), 1.0)
        ax.legend(fontsize=7)
        paths.append(_save(fig, os.path.join(out, "figures", f"ppll_accuracy_{model}.png")))
    return paths


# --------------------------------------------------------------------- main


TABLES = {
    "cdp-table": ("cdp", cdp_rows, cdp_markdown, cdp_figures),
    "ppll-table": ("ppll", ppll_rows, ppll_markdown, ppll_figures),
}


def reproduce(which: str, tiny: bool, out: str, steps: int | None, overrides=(), bandwidth: float = 100e9,
              only=None) -> dict:
    """Runs the rows of one table (`cdp-table`, `ppll-table`), writes OUT/<table>_table.md and
    the figures; returns {'markdown': str, 'records': [...], 'figures': [...]}."""
    from tqdm.auto import tqdm

    name, rows_fn, markdown_fn, figures_fn = TABLES[which]
    rows = [r for r in rows_fn(tiny) if not only or any(fnmatch.fnmatch(r.name, pattern) for pattern in only)]
    records = []
    bar = tqdm(rows, desc=which, unit="row", dynamic_ncols=True)
    for row in bar:
        bar.set_postfix_str(row.name)
        records.append(run_row(row, out, steps, overrides, bandwidth, BENCH_REPEATS[tiny],
                              log=lambda line: tqdm.write(line, file=sys.stderr)))
    md = markdown_fn(records)
    with open(os.path.join(out, f"{name}_table.md"), "w") as f:
        f.write(md)
    figures = figures_fn(records, out)
    return {"markdown": md, "records": records, "figures": figures}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a[len("--config."):] for a in argv if a.startswith("--config.")]
    argv = [a for a in argv if not a.startswith("--config.")]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("table", choices=(*TABLES, "all"))
    p.add_argument("--tiny", action="store_true", help=f"digits configs, {TINY_STEPS} steps: minutes on 2 cores")
    p.add_argument("--out", help="output directory (default out/tiny or out/paper)")
    p.add_argument("--steps", type=int, help=f"training steps per row (tiny default {TINY_STEPS}; else the "
                   "configs' own, schedules scaled to the new length)")
    p.add_argument("--bandwidth", type=float, default=100e9, help="bytes/s between devices for the prediction")
    p.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices where no accelerator is present")
    p.add_argument("--only", action="append", metavar="PATTERN",
                   help="only the rows whose name matches PATTERN (fnmatch, e.g. 'ppll-mlp-K2-*'; repeatable)")
    args = p.parse_args(argv)

    # Before anything initialises JAX's backends.
    from cdpjax.mesh import setup_devices

    setup_devices(args.cpu_devices)
    from cdpjax.errors import ConfigError

    if args.steps is not None and args.steps < 1:
        p.error(f"--steps {args.steps} must be >= 1")
    steps = args.steps if args.steps is not None else (TINY_STEPS if args.tiny else None)
    out = args.out or os.path.join("out", "tiny" if args.tiny else "paper")
    os.makedirs(out, exist_ok=True)
    try:
        for which in (TABLES if args.table == "all" else (args.table,)):
            result = reproduce(which, args.tiny, out, steps, overrides, args.bandwidth, args.only)
            print(f"\n## {which} ({'tiny' if args.tiny else 'paper configs'})\n\n{result['markdown']}")
            print("figures:", *result["figures"], sep="\n  ")
    except ConfigError as e:
        print(f"reproduce: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
