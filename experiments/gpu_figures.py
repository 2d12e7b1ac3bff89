"""GPU figures on ONE GPU: step times, images per second, memory and speedup predictions.

    PYTHONPATH=. python experiments/gpu_figures.py --out out/gpu_figures.json   # what gpu_figures.sh runs
    python experiments/gpu_figures.py --table out/gpu_figures.json              # docs/measured.md's GPU section
    python experiments/gpu_figures.py --tiny --out /tmp/g.json                  # tiny models, any CPU

Workloads (synthetic data of CIFAR shape, 32x32x3, 10 classes; no download):
- `resnet18`: ResNet-18 with the CIFAR stem (`cdpjax.models.resnet18`), BatchNorm,
  global batch 512; stages cut at [3, 6, 8] (`cdpjax/configs/bench_resnet18.py`).
- `vit_b`: ViT-B shape (768 wide, 12 heads, 12 blocks, MLP 3072) as `cdpjax.models.vit_b`
  takes a 32x32 input, i.e. patch 4 (64 patches + a class token: the PPLL setup of
  `cdpjax/configs/ppll_vit.py` on CIFAR-10), not the 224x224 ViT-B/16; global
  batch 128; 4 stages.
Each in float32 and bfloat16 (`config.dtype`: bfloat16 computation, float32 parameters).

What is measured, every figure on the one device, side by side in one process
(`cdpjax.bench.bench_method`: compile time, the median step time after warm-up, images
per second, XLA's compiled memory analysis):
- `e2e` and `dp` on the one device (`mesh.data=1`: the shard_map path's own cost);
- `cdp-v2` as `cdp_impl='simulate'` with 4 workers on the one device, against dp;
- per-stage forward and backward times (`cdpjax.speedup.measure_stage_costs`) and the
  speedup model's prediction (`cdpjax.speedup.simulate`) of the CDP ring (cdp-v2, N = L = 4)
  and of ppll (K = 4) on 4 such devices, with `--bandwidth` bytes/s between devices.

- `cdpjax plan` on the one device (`plan`): ResNet-18's candidates ranked by the lockstep
  model's step time from block times measured here (no memory budget: every candidate), and
  the top 3 benched: each one's predicted step beside its measured one, its predicted memory
  beside XLA's (--tiny: three methods, to keep the smoke test short).

- every device of the machine (`host`): `gpipe` trained for a few steps, in its own
  process, on a (stage, data) mesh filling them (pipeline replicas over `data`, ViT-B's 4
  stages; --tiny: vit_tiny's 2 stages on 4 simulated CPU devices), with its images per
  second and the fraction of the timed steps spent waiting for input (summary.json's
  `input_wait_fraction`); skipped where the stages cannot fill the devices.

The tasks run in order of importance and the JSON file is rewritten after each, so
that a run stopped at any point keeps what it measured; past `--budget` seconds the
remaining tasks are recorded as skipped, and a task that fails (out of memory...) is
recorded with its error and the others go on. The script uses the first device only,
whatever the machine has (one GPU; `--tiny` on one CPU device), but for the `host` task.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback

DTYPES = ("float32", "bfloat16")
CIFAR = {"dataset": "synthetic", "image_shape": (32, 32, 3)}
WORKLOADS = {
    "resnet18": dict(model="resnet18", model_kwargs={"stem": "cifar"}, norm="batch", batch=512, stages=[3, 6, 8],
                     aux_head="greedy", **CIFAR),
    "vit_b": dict(model="vit_b", model_kwargs={}, norm="none", batch=128, stages=4, aux_head="vit", **CIFAR),
}
# --tiny: models of the same families small enough for a CPU in seconds (a smoke test).
TINY = {
    "resnet18": dict(model="resnet_tiny", model_kwargs={"depths": (1,), "widths": (4,)}, norm="batch", batch=8,
                     stages=2, aux_head="greedy", dataset="synthetic", image_shape=(8, 8, 3)),
    "vit_b": dict(model="vit_tiny", model_kwargs={"depth": 1, "dim": 8, "heads": 1, "mlp_dim": 16}, norm="none",
                  batch=8, stages=2, aux_head="vit", dataset="synthetic", image_shape=(8, 8, 3)),
}
# Devices of the predictions, which are also cdp-v2's workers on the one device: one per stage
# (N = L = K = 4; --tiny: 2).
DEVICES = {"full": 4, "tiny": 2}
PREDICTED = ("cdp-v2", "ppll")
# The `host` task: a stage-axis method on every device, and how many simulated CPU devices --tiny gives it.
HOST_METHOD, HOST_WORKLOAD, HOST_STEPS, TINY_HOST_DEVICES = "gpipe", "vit_b", {"full": 30, "tiny": 6}, 4
# The `plan` task: its workload, how many of its ranking are benched, and --tiny's methods.
PLAN_WORKLOAD, PLAN_TOP, TINY_PLAN_METHODS = "resnet18", 3, ("e2e", "dp", "interleaved-1f1b")
# H200 SXM: NVLink 4, 18 links of 25 GB/s per direction = 450 GB/s each way.
NVLINK_BANDWIDTH = 450e9


def plan(tiny: bool = False) -> list[tuple[str, str, str, str]]:
    """(kind, workload, dtype, method) in order of importance: e2e step times, the float32
    predictions, cdp-v2 against dp, then the rest. `tiny`: each kind of task once, each
    workload and dtype at least once (what a CPU smoke test can afford)."""
    host = ("host", HOST_WORKLOAD, "float32", HOST_METHOD)
    ranked = ("plan", PLAN_WORKLOAD, "float32", "plan")
    if tiny:
        return [("step", "resnet18", "bfloat16", "e2e"), ("step", "vit_b", "float32", "e2e"),
                ("prediction", "resnet18", "bfloat16", "cdp-v2"), ("prediction", "vit_b", "float32", "ppll"),
                ("step", "resnet18", "float32", "dp"), ("step", "resnet18", "float32", "cdp-v2"), host, ranked]
    tasks = [("step", w, d, "e2e") for w in WORKLOADS for d in DTYPES]
    tasks += [("prediction", w, "float32", m) for w in WORKLOADS for m in PREDICTED] + [ranked]
    tasks += [("step", "resnet18", "float32", "dp"), ("step", "resnet18", "float32", "cdp-v2"), host]
    rest = [("step", w, d, m) for w in WORKLOADS for d in DTYPES for m in ("dp", "cdp-v2")]
    tasks += [t for t in rest if t not in tasks]
    tasks += [("prediction", w, "bfloat16", m) for w in WORKLOADS for m in PREDICTED]
    return tasks


def config_for(workload: dict, method: str, dtype: str, workers: int):
    """The workload's config for `method` on one device (cdp-v2: simulate, `workers` workers)."""
    from cdpjax.config import default_config

    c = default_config()
    c.method, c.model, c.norm = method, workload["model"], workload["norm"]
    c.model_kwargs = dict(workload["model_kwargs"])
    c.dataset = workload["dataset"]
    c.dataset_kwargs = {"image_shape": tuple(workload["image_shape"]), "num_classes": 10}
    c.global_batch_size, c.stages, c.dtype = workload["batch"], workload["stages"], dtype
    c.aux_head, c.augment, c.num_steps = workload["aux_head"], False, 10
    if method in ("dp", "cdp-v2"):
        c.mesh = {"data": 1}
    if method == "cdp-v2":
        c.cdp_impl, c.workers = "simulate", workers
    return c


def step_record(config, device, repeats: int) -> dict:
    """Compile time, median step time, images per second and memory of one method on `device`."""
    from cdpjax import bench

    r = bench.bench_method(config, devices=[device], warmup=2, repeats=repeats)
    keep = ("devices", "stages", "workers", "global_batch_size", "compile_seconds", "step_seconds",
            "images_per_second", "memory", "param_bytes")
    return {k: r[k] for k in keep if k in r}


def prediction_record(config, devices: int, bandwidth: float) -> dict:
    """Per-stage times measured here and the speedup model's step time on `devices` devices."""
    from cdpjax import speedup

    config = config.copy_and_resolve_references()
    config.mesh, config.workers, config.cdp_impl = {}, 0, "ring"  # the real layout, one worker per device
    p = speedup.predict_for_config(config, devices, bandwidth)
    p.pop("assumptions", None)  # once, in the file's settings
    return {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()}


def plan_record(workload: dict, device, repeats: int, bandwidth: float, tiny: bool) -> dict:
    """`cdpjax plan` for the one device with no budget (`cdpjax.plan.make_plan`: block times
    measured here, in a fresh cache), its top `PLAN_TOP` benched on `device`: predicted and
    measured step seconds, predicted and XLA's held bytes, each candidate's label."""
    import math
    import tempfile

    from cdpjax import bench
    from cdpjax import plan as plan_lib

    base = config_for(workload, "e2e", "float32", 1)
    with tempfile.TemporaryDirectory(prefix="gpu-figures-plan-") as cache:  # measured here, not read from another run
        ranked = plan_lib.make_plan(base, 1, math.inf, bandwidth, TINY_PLAN_METHODS if tiny else None, cache=cache)
    top = []
    for p in ranked.ranked[:PLAN_TOP]:
        r = bench.bench_method(p.candidate.config(base), devices=[device], warmup=2, repeats=repeats)
        top.append({"label": p.candidate.label(), "predicted_step_seconds": p.step_seconds,
                    "measured_step_seconds": r["step_seconds"], "predicted_bytes": p.memory,
                    "held_bytes": r["memory"]["held_bytes"]})
    return {"candidates": len(ranked.predictions), "top": top}


def host_config(workload: dict, steps: int):
    """`HOST_METHOD` on a (stage, data) mesh over every device: the workload's stages on `stage`,
    pipeline replicas over `data`; logged once, no evaluation or checkpoint before the end."""
    c = config_for(workload, HOST_METHOD, "float32", 1)
    c.mesh, c.microbatches, c.num_steps = {"stage": c.stages, "data": -1}, 2, steps
    c.log_every, c.eval_every, c.checkpoint_every = steps, 0, 0
    return c


def host_record(tiny: bool) -> dict:
    """The `host` task, in its own process (this one uses the first device only): `main(['--host', ...])`
    trains and prints summary.json's figures; the record keeps the mesh, the devices, images per
    second and the input-wait fraction."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu-figures-host-") as workdir:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--host", workdir, *(["--tiny"] * tiny)],
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def host_run(workdir: str, tiny: bool) -> dict:
    """Trains the `host` task's config in `workdir` on every device (--tiny: 4 simulated CPU
    devices); its figures, or why the stages cannot fill the devices."""
    from cdpjax.mesh import setup_devices

    setup_devices(TINY_HOST_DEVICES if tiny else None)
    import jax

    from cdpjax import train

    config = host_config((TINY if tiny else WORKLOADS)[HOST_WORKLOAD], HOST_STEPS["tiny" if tiny else "full"])
    stages, devices = config.stages, jax.device_count()
    if devices < 2 * stages or devices % stages:
        return {"skipped": f"{stages} stages cannot fill {devices} device{'s' * (devices != 1)} with 2 or more "
                           f"pipeline replicas"}
    s = train.train(config, workdir, progress=False)
    return {k: s[k] for k in ("mesh", "devices", "stages", "steps", "global_batch_size", "images_per_second",
                              "input_wait_fraction")}


def run_task(task, workloads, devices: int, device, repeats: int, bandwidth: float, tiny: bool = False) -> dict:
    """One task's record; `devices`: of the predictions and cdp-v2's workers, `device`: where it runs."""
    kind, name, dtype, method = task
    config = config_for(workloads[name], method, dtype, devices)
    record = {"kind": kind, "workload": name, "model": config.model, "dtype": dtype, "method": method,
              "global_batch_size": config.global_batch_size}
    t0 = time.perf_counter()
    try:
        if kind == "step":
            record.update(step_record(config, device, repeats))
        elif kind == "host":
            record.update(host_record(tiny))
        elif kind == "plan":
            record.update(plan_record(workloads[name], device, repeats, bandwidth, tiny))
        else:
            record.update(prediction_record(config, devices, bandwidth))
    except Exception as e:  # noqa: BLE001 - one task's failure (out of memory...) must not lose the others
        record["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:500]}"
        record["traceback"] = traceback.format_exc()[-2000:]
    record["task_seconds"] = time.perf_counter() - t0
    return record


def environment() -> dict:
    import flax
    import jax
    import jaxlib
    import optax

    device = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "python": platform.python_version(), "backend": jax.default_backend(), "platform": device.platform,
            "device": device.device_kind, "device_count": jax.device_count(), "git_commit": commit or None}


def write(doc: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)


def measure(out: str, tiny: bool, budget: float, repeats: int, bandwidth: float) -> dict:
    """Runs `plan()` on the first device, writing `out` after every task; returns the document."""
    import jax

    from cdpjax import speedup

    start = time.perf_counter()
    workloads, devices = (TINY, DEVICES["tiny"]) if tiny else (WORKLOADS, DEVICES["full"])
    if tiny:  # initialisers compile per parameter shape; rbg's generator compiles far faster on CPU
        jax.config.update("jax_default_prng_impl", "rbg")
    doc = {"environment": environment(),
           "settings": {"tiny": tiny, "budget_seconds": budget, "repeats": repeats, "bandwidth": bandwidth,
                        "devices": devices, "workloads": workloads,
                        "speedup_assumptions": speedup.__doc__.split("Assumptions (stated, not hidden):")[1].strip()},
           "records": []}
    device = jax.devices()[0]
    for task in plan(tiny):
        spent = time.perf_counter() - start
        if spent > budget:
            kind, name, dtype, method = task
            doc["records"].append({"kind": kind, "workload": name, "dtype": dtype, "method": method,
                                   "skipped": f"time budget: {spent:.0f} s of {budget:.0f} s spent"})
        else:
            print(f"gpu_figures: {' '.join(task)} ({spent:.0f} s)", file=sys.stderr, flush=True)
            doc["records"].append(run_task(task, workloads, devices, device, repeats, bandwidth, tiny))
        doc["wall_seconds"] = time.perf_counter() - start
        write(doc, out)
    return doc


# ----------------------------------------------------------------------------- markdown


def _find(records, **match):
    """The first measured record with these fields."""
    for r in records:
        if all(r.get(k) == v for k, v in match.items()) and "step_seconds" in r:
            return r
    return None


def _ms(r) -> str:
    return f"{r['step_seconds'] * 1e3:.1f}" if r else "-"


def _mib(r) -> str:
    mem = (r or {}).get("memory")
    return f"{mem['temp_bytes'] / 2**20:.0f} / {mem['argument_bytes'] / 2**20:.0f}" if mem else "-"


def step_rows(doc: dict) -> list[str]:
    """One row per workload and dtype: e2e, dp and cdp-v2 simulate on the one device."""
    settings, records = doc["settings"], doc["records"]
    rows = ["| workload (batch) | dtype | e2e ms/step | e2e images/s | e2e temp / args MiB | dp, 1 device, ms "
            f"| cdp-v2 simulate, {settings['devices']} workers, ms (x dp) |", "|---|---|---|---|---|---|---|"]
    for name, workload in settings["workloads"].items():
        for dtype in DTYPES:
            e2e, dp, cdp = (_find(records, kind="step", workload=name, dtype=dtype, method=m)
                            for m in ("e2e", "dp", "cdp-v2"))
            ips = f"{e2e['images_per_second']:.0f}" if e2e else "-"
            ratio = f" (x{cdp['step_seconds'] / dp['step_seconds']:.2f})" if cdp and dp else ""
            rows.append(f"| {name} ({workload['batch']}) | {dtype} | {_ms(e2e)} | {ips} | {_mib(e2e)} | {_ms(dp)} "
                        f"| {_ms(cdp)}{ratio} |")
    return rows


def prediction_rows(doc: dict) -> list[str]:
    """One row per prediction: the stage times it is made of, the step time and the speedup."""
    rows = ["| workload | dtype | method | micro-batch | stage forward / backward ms | step ms "
            "| speedup over 1 device |",
            "|---|---|---|---|---|---|---|"]
    for r in doc["records"]:
        if r["kind"] == "prediction" and "step_seconds" in r:
            stages = " ; ".join(f"{f * 1e3:.2f}/{b * 1e3:.2f}" for f, b in zip(r["stage_forward"], r["stage_backward"]))
            rows.append(f"| {r['workload']} | {r['dtype']} | {r['method']} | {r['micro_batch']} | {stages} | "
                        f"{r['step_seconds'] * 1e3:.2f} | {r['speedup']:.2f} |")
    return rows


def host_rows(doc: dict) -> list[str]:
    """The `host` task: a stage-axis method on every device, and how long its steps waited for input."""
    rows = ["| method | workload (batch) | mesh | devices | images/s | input wait |", "|---|---|---|---|---|---|"]
    for r in doc["records"]:
        if r["kind"] == "host" and "images_per_second" in r:
            rows.append(f"| {r['method']} | {r['workload']} ({r['global_batch_size']}) | {r['mesh']} | {r['devices']} "
                        f"| {r['images_per_second']:.0f} | {r['input_wait_fraction']:.1%} |")
    return rows


def plan_rows(doc: dict) -> list[str]:
    """The `plan` task: the top of `cdpjax plan`'s ranking on the one device, predicted against measured."""
    rows = ["| candidate | predicted ms | measured ms | measured / predicted | predicted / XLA MiB |",
            "|---|---|---|---|---|"]
    for r in doc["records"]:
        for c in r.get("top", []) if r["kind"] == "plan" else []:
            rows.append(f"| {c['label']} | {c['predicted_step_seconds'] * 1e3:.2f} | "
                        f"{c['measured_step_seconds'] * 1e3:.2f} | "
                        f"{c['measured_step_seconds'] / c['predicted_step_seconds']:.2f} | "
                        f"{c['predicted_bytes'] / 2**20:.0f} / {c['held_bytes'] / 2**20:.0f} |")
    return rows


def table(doc: dict) -> str:
    """The markdown of docs/measured.md's GPU section: step times on one device, then the
    predictions on `devices` devices."""
    env, settings = doc["environment"], doc["settings"]
    lines = [f"{env['device']} x1 ({env['backend']}), JAX {env['jax']}, {env['date'][:10]}"
             f"{' (--tiny)' if settings['tiny'] else ''}", "", *step_rows(doc), "",
             f"Predicted on {settings['devices']} devices at {settings['bandwidth'] / 1e9:.0f} GB/s "
             f"(`cdpjax.speedup`, from per-stage times measured on the one device):", "", *prediction_rows(doc), "",
             "Every device of the machine, pipeline replicas over `data` (its own process):", "", *host_rows(doc), "",
             f"`cdpjax plan` on the one device ({PLAN_WORKLOAD}): its top {PLAN_TOP}, predicted and measured:", "",
             *plan_rows(doc)]
    missing = [r for r in doc["records"] if "skipped" in r or "error" in r]
    if missing:
        lines += ["", "Not measured: " + "; ".join(
            f"{r['kind']} {r['workload']} {r['dtype']} {r['method']} ({r.get('skipped') or r.get('error')})"
            for r in missing)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "gpu_figures.json"))
    parser.add_argument("--table", metavar="FILE.json", help="print the markdown table of a results file and exit")
    parser.add_argument("--host", metavar="WORKDIR", help="the host task alone, in WORKDIR; its figures as JSON")
    parser.add_argument("--tiny", action="store_true", help="tiny models and batches (a CPU smoke test)")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds after which remaining tasks are skipped")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per step measurement (median)")
    parser.add_argument("--bandwidth", type=float, default=NVLINK_BANDWIDTH,
                        help="bytes/s between devices for the predictions (default: H200 NVLink, one direction)")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    if args.tiny:  # before JAX starts: a smoke test measures nothing, so skip LLVM's optimisation (1.5x faster)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    if args.host:
        print(json.dumps(host_run(args.host, args.tiny)))
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    doc = measure(args.out, args.tiny, args.budget, args.repeats, args.bandwidth)
    print(table(doc))
    print(f"gpu_figures: {args.out} ({doc['wall_seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
