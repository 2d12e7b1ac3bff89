"""Writes the notebooks of colab/ from the cell sources below (run it after editing them).

    python colab/make_notebooks.py

The notebooks are generated so that their code can be reviewed here as plain
Python and so that the cells they share (install, devices, config loading) are
written once. Each notebook opens in Colab (its first cell names the repository
and installs cdpjax from it where cdpjax is missing, restarting the runtime
where pip replaced a module the kernel had loaded) and runs the paper's config
on a GPU, or the tiny digits config where chosen (TINY = True in the set-up
cell, or CDPJAX_TINY=1); without a GPU and without that choice it stops with
one line saying what to change. Figures go to $CDPJAX_FIGURES (default
figures/) and are shown. tests/test_notebooks.py runs every notebook on its
tiny config in a real kernel, and one as on Colab's own packages.
"""
from __future__ import annotations

import os
import textwrap

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY = "cdpjax/cdpjax"


def _src(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def badge(name: str) -> str:
    url = f"https://colab.research.google.com/github/{REPOSITORY}/blob/main/colab/{name}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


# Colab preloads numpy (and with it what imports it) into every kernel: a module that pip replaces on
# disk stays loaded in memory, and jax imported next would run against it. Kept apart from INSTALL so
# that tests/test_notebooks.py can run the rule as plain Python; INSTALL holds it verbatim.
RESTART_RULE = _src("""
    PRELOADED = ("numpy", "jax", "jaxlib", "ml_dtypes", "scipy")


    def after_install(loaded, installed, in_colab):
        \"\"\"What the install cell does once pip is done: ("go on", ""), ("restart", line) in Colab, or
        ("stop", line) elsewhere, where loaded maps each module already imported to its version in memory
        and installed maps names to the version pip left on disk (None: not installed as a distribution).
        A module loaded without a version (None) may be the old one: it counts as replaced.\"\"\"
        stale = [f"{name} {loaded[name] or '(version unknown)'} -> {installed[name]}" for name in sorted(loaded)
                 if installed.get(name) is not None and installed[name] != loaded[name]]
        if not stale:
            return "go on", ""
        said = f"pip replaced modules this kernel had loaded ({', '.join(stale)})"
        if in_colab:  # the install cell is a no-op after the restart: cdpjax is then installed
            return "restart", f"{said}: restarting the runtime; then run all again"
        return "stop", f"{said}: restart the kernel, then run all"
""")

INSTALL = _src(f"""
    # Where cdpjax comes from (a fork: change it here).
    REPOSITORY = "https://github.com/{REPOSITORY}"
    print(f"cdpjax from {{REPOSITORY}}")

    import importlib.util

    if importlib.util.find_spec("cdpjax") is None:  # Colab; a checkout or CI already has it
        import importlib.metadata
        import os
        import sys

        # jax is upgraded with its CUDA plugin (the cuda12 extra, on a GPU runtime only: on a CPU one its
        # NVIDIA wheels are gigabytes for nothing) and flax with it: Colab's jax 0.7.2 has no lax.pcast,
        # and its flax 0.11.2 fails on a newer jax, so both move to cdpjax's bounds (jax >= 0.10,
        # flax >= 0.12.8), and numpy may move to what the newest jax needs; pip may then warn that other
        # Colab packages ask for an older numpy: this notebook does not use them.
        EXTRA = "[cuda12]" if os.path.exists("/dev/nvidia0") else ""
        %pip install -q "cdpjax{{EXTRA}} @ git+{{REPOSITORY}}"

{textwrap.indent(RESTART_RULE, " " * 8)}


        importlib.invalidate_caches()
        loaded = {{name: getattr(sys.modules[name], "__version__", None) for name in PRELOADED if name in sys.modules}}
        installed = {{}}
        for name in loaded:
            try:
                installed[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                installed[name] = None
        # Colab's kernel imports google.colab, and its runtime sets COLAB_RELEASE_TAG: either will do.
        in_colab = "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ
        action, line = after_install(loaded, installed, in_colab)
        if action == "restart":
            print(line, flush=True)
            os.kill(os.getpid(), 9)  # Colab's way to restart the runtime: it starts a fresh kernel
        elif action == "stop":
            raise SystemExit(line)
""")

SETUP = _src("""
    import os

    from cdpjax.mesh import setup_devices

    setup_devices(8)  # 8 simulated CPU devices where there is no accelerator; must precede JAX's start

    import jax
    from IPython.display import Image, display

    # The tiny config runs on a CPU in minutes; set TINY = True (or CDPJAX_TINY=1) to choose it.
    TINY = os.environ.get("CDPJAX_TINY") == "1"  # or: TINY = True
    ACCELERATOR = jax.default_backend() != "cpu"
    if not ACCELERATOR and os.path.exists("/dev/nvidia0"):
        raise SystemExit("a GPU is here but jax runs on the CPU: rerun the install cell, then Runtime > Restart "
                         "session (jax must be imported after its CUDA plugin is installed)")
    if not ACCELERATOR and not TINY:
        raise SystemExit("no GPU: choose Runtime > Change runtime type > a GPU, or set TINY = True in this cell "
                         "(the tiny config, on the CPU)")
    FIGURES = os.environ.get("CDPJAX_FIGURES", "figures")
    os.makedirs(FIGURES, exist_ok=True)
    print(f"{jax.device_count()} {jax.default_backend()} device(s): the {'tiny' if TINY else 'GPU-sized'} "
          f"config; figures go to {FIGURES}/")
""")

CONFIGS = _src("""
    from cdpjax import config as cfg_lib


    def load_config(spec):
        \"\"\"'NAME:ARGS' of a config shipped with cdpjax (cdpjax/configs/NAME.py) -> ConfigDict.\"\"\"
        return cfg_lib.load_file(spec)


    def devices_for(config):
        \"\"\"The first devices the method's mesh takes here (cdpjax.layouts.devices_to_use); none where it
        cannot run on the devices there are (gpipe's K stage devices on fewer).\"\"\"
        from cdpjax.layouts import devices_to_use

        return jax.devices()[:devices_to_use(config, jax.device_count())]


    def fits(config):
        return bool(devices_for(config))
""")

PREPARE_CIFAR = _src("""
    # GPU-sized config only: CIFAR-10 prepared once for tensorflow-datasets (internet; Colab has TensorFlow).
    # In a process of its own with the GPU hidden: jax already holds the GPU in this kernel, and TensorFlow
    # would load its own CUDA libraries beside jax's and claim GPU memory.
    if not TINY:
        import subprocess
        import sys

        PREPARE = ("import tensorflow_datasets as tfds; builder = tfds.builder('cifar10'); "
                   "builder.is_prepared() or builder.download_and_prepare(file_format='array_record')")
        done = subprocess.run([sys.executable, "-c", PREPARE], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                              capture_output=True, text=True)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise SystemExit(f"CIFAR-10 could not be prepared (internet needed): {last}")
""")

RUNS_CELL = _src("""
    # Where the runs go (checkpoints, metrics.jsonl): a run resumes from its last checkpoint when its cell
    # is rerun. Colab wipes /content (and runs/ in it) when the runtime is recycled (idle, time limit, a
    # new session): set DRIVE = True to keep them on Google Drive and resume there after a new runtime.
    DRIVE = False
    if DRIVE:
        from google.colab import drive

        drive.mount("/content/drive")
        RUNS = "/content/drive/MyDrive/cdpjax/runs"
    else:
        RUNS = os.environ.get("CDPJAX_RUNS", "runs")
    os.makedirs(RUNS, exist_ok=True)
    print(f"runs go to {RUNS}/")
""")

METRICS = _src("""
    import json


    def read_metrics(workdir):
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
""")


# ------------------------------------------------------------------ notebooks


def timing_diagrams():
    name = "cdp_timing_diagrams.ipynb"
    return name, [
        new_markdown_cell(_src(f"""
            # Timing diagrams: DP, CDP-v1, CDP-v2, cdp-mp and PPLL

            {badge(name)}

            Reproduces the timing diagram of *Cyclic Data Parallelism* (Fournier and Oyallon,
            arXiv 2403.08837): time steps (ticks) on x, stages on y, one colour per worker, forward
            light and backward dark, operations that read the previous parameter version hatched,
            updates marked in red. With the pipelines of *PPLL* (Guo et al., arXiv 2411.12780) and
            GPipe for comparison. Every picture is drawn from `cdpjax.timetable`, the one table that
            the SPMD implementations, the staleness rules and the memory model also read.

            Tables are pure Python: the GPU-sized and the tiny config (`TINY = True`) draw the same
            sizes (the paper's N = L = 4 and its runs' N = 8 workers on L = 4 stages); the tiny one
            draws fewer steps. No GPU is needed: on a CPU runtime, choose the tiny config.

            How long: the tiny config took 25 to 40 seconds on this project's 2-core CPU machine
            (measured twice, the machine shared with other work); the GPU-sized one draws a step more, about as long.
        """)),
        new_code_cell(INSTALL),
        new_code_cell(SETUP),
        new_code_cell(_src("""
            from cdpjax import methods, plotting, timetable

            STEPS = 2 if TINY else 3
            SIZES = [(4, 4), (8, 4)]  # (workers N, stages L)


            def show(table, filename, text=True):
                if text:
                    print(table.format_grid(), end="\\n\\n")
                display(Image(plotting.plot_schedule(table, os.path.join(FIGURES, filename))))
        """)),
        new_markdown_cell(_src("""
            ## DP against CDP

            DP: every worker runs the same phase at the same tick, and all update together at the end
            of the step. CDP: worker i starts 2L*i/N ticks later, so with N = L every stage is used by
            exactly one worker at every tick. CDP-v1 reads the previous version everywhere; CDP-v2
            only where the update of the previous step has not landed yet.
        """)),
        new_code_cell(_src("""
            for workers, stages in SIZES:
                for method in ("dp", "cdp-v1", "cdp-v2"):
                    table = timetable.table(method, workers=workers, stages=stages, steps=STEPS)
                    show(table, f"timing_{method}_N{workers}_L{stages}.png", text=workers == stages)
        """)),
        new_markdown_cell(_src("""
            ## CDP-v2's delays for N != L

            The rule "fresh iff j >= L-1-i" of the paper's reference code holds for N = L only. With
            N = 8 workers on L = 4 stages the table says that half of the (worker, stage) pairs read
            the previous version; the hard-coded rule delays about 19% of them.
        """)),
        new_code_cell(_src("""
            import numpy as np
            from matplotlib.figure import Figure

            N, L = 8, 4
            table = timetable.table("cdp-v2", workers=N, stages=L, steps=STEPS)
            reference = np.array([[j < L - 1 - i for j in range(L)] for i in range(N)])
            print(f"delayed (worker, stage) pairs: from the table {table.stale.mean():.0%}, "
                  f"reference code's N = L rule {reference.mean():.0%}")
            fig = Figure(figsize=(6, 3.6), layout="constrained")
            for k, (title, stale) in enumerate((("time table", table.stale), ("reference code's rule", reference))):
                ax = fig.add_subplot(1, 2, k + 1)
                ax.imshow(stale, cmap="Greys", vmin=0, vmax=1.5)
                ax.set(title=title, xlabel="stage", ylabel="worker", xticks=range(L), yticks=range(N))
            fig.suptitle(f"cdp-v2, N={N}, L={L}: reads the previous version (dark)")
            path = os.path.join(FIGURES, "staleness_cdp-v2_N8_L4.png")
            fig.savefig(path, bbox_inches="tight", dpi=120)
            display(Image(path))
        """)),
        new_markdown_cell(_src("""
            ## cdp-mp: stages on devices, workers flowing through them

            Drawn when the `cdp-mp` method is registered in the installed cdpjax.
        """)),
        new_code_cell(_src("""
            if "cdp-mp" in methods.REGISTRY:
                show(timetable.table("cdp-mp", stages=4, steps=STEPS), "timing_cdp-mp_N4_L4.png")
            else:
                print("cdp-mp is not registered in this cdpjax: no diagram")
        """)),
        new_markdown_cell(_src("""
            ## PPLL against GPipe

            PPLL: at tick t stage j runs batch t-j (forward, local backward through its auxiliary head,
            update); no gradient crosses a stage, so after K-1 fill ticks every device is busy at every
            tick. GPipe: M micro-batches fill and drain the pipeline every step (the bubble); M = 1 is
            plain model parallelism, the "conventional pipeline" of PPLL's code.
        """)),
        new_code_cell(_src("""
            K = 4
            show(timetable.table("ppll", stages=K, steps=6 if TINY else 10), f"timing_ppll_K{K}.png")
            show(timetable.table("gpipe", stages=K, microbatches=4, steps=STEPS), f"timing_gpipe_K{K}_M4.png")
            show(timetable.table("gpipe", stages=K, microbatches=1, steps=STEPS), f"timing_gpipe_K{K}_M1.png", text=False)
        """)),
    ]


def memory_and_communication():
    name = "cdp_memory_and_communication.ipynb"
    return name, [
        new_markdown_cell(_src(f"""
            # Activation memory and communication: DP against CDP

            {badge(name)}

            Reproduces two figures of *Cyclic Data Parallelism* (arXiv 2403.08837):

            - **activation memory over time**: in DP all workers hold their activations at the same
              time (N*L stage-activations at the end of the forward pass); in CDP the phases are
              spread and the total stays near N*L/2 at every tick;
            - **communication per time step**: DP sends one all-reduce of the whole model at the end
              of the step; CDP sends one stage's gradient a hop along the ring every tick.

            Both come from the time table (`cdpjax.timetable`) and the model's stage sizes; then the
            compiled steps of `dp` and `cdp-v2` are measured (`cdpjax.bench`: XLA memory analysis per
            device, the collectives in the compiled HLO). GPU-sized config: ResNet-18 on CIFAR-10-shaped
            inputs, 8 workers, 4 stages, 64 images per worker (random images: only shapes matter here).
            Tiny (`TINY = True`): the 4-stage MLP on digits, 8 workers on 8 simulated CPU devices.

            How long: the tiny config took 1 to 2 minutes on this project's 2-core CPU machine (measured
            twice, the machine shared with other work), most of it compiling the two steps. The GPU-sized
            config on a Colab T4: a few minutes, mostly compiling ResNet-18's steps (an estimate, not
            a measurement).
        """)),
        new_code_cell(INSTALL),
        new_code_cell(SETUP),
        new_code_cell(CONFIGS),
        new_code_cell(_src("""
            import ml_collections

            if TINY:
                base = load_config("digits:method=cdp-v2")
            else:
                base = load_config("cdp_cifar10:model=resnet18,method=cdp-v2")
                base.dataset, base.dataset_kwargs = "synthetic", {"image_shape": (32, 32, 3), "num_classes": 10}
                if jax.device_count() < 8:  # the ring needs one device per worker; simulate otherwise
                    base.cdp_impl, base.mesh = "simulate", {"data": 1}


            def method_config(method):
                c = ml_collections.ConfigDict(base.to_dict())
                c.method = method
                if method == "dp" and c.cdp_impl == "simulate":  # dp has no simulation: its workers on the devices
                    c.mesh = {"data": -1}
                return c


            # What the measurements below compile, each on devices_for(config).
            PLAN = {m: method_config(m) for m in ("dp", "cdp-v2")}
        """)),
        new_code_cell(_src("""
            from cdpjax import bench, data, models, plotting, timetable

            dataset = data.build(base)
            net = models.build(base, dataset.image_shape, dataset.num_classes)
            N = base.workers or jax.device_count()
            L = net.num_stages
            sizes = bench.stage_sizes(net, base.global_batch_size // N)
            print(f"{base.model}: N={N} workers, L={L} stages, {base.global_batch_size // N} images per worker")
            print("stage parameters (bytes):", sizes["param_bytes"])
            print("stage outputs per micro-batch (bytes):", sizes["activation_bytes"])
        """)),
        new_markdown_cell("## Activation memory over time"),
        new_code_cell(_src("""
            tables = {m: timetable.table(m, workers=N, stages=L, steps=4) for m in ("dp", "cdp-v1", "cdp-v2")}
            for m, t in tables.items():
                s = t.activation_stats()
                print(f"{m:>7}: all workers peak {s['total_peak']} mean {s['total_mean']:.1f} stage-activations; "
                      f"one worker peak {s['worker_peak']}")
            # cdp-v1 and cdp-v2 share one timing: one CDP line.
            path = plotting.plot_activation([tables["dp"], tables["cdp-v2"]],
                                            os.path.join(FIGURES, "activation_over_time.png"))
            display(Image(path))
        """)),
        new_markdown_cell(_src("""
            The same in bytes: each stage's output is held from its forward until its backward, and
            weighs what that stage's output weighs for one micro-batch (`TimeTable.activation_bytes`).
            The unit model says CDP holds half of DP's peak whatever the cut; in bytes the cut decides
            (`partition='memory'` picks the cut that holds the fewest).
        """)),
        new_code_cell(_src("""
            import numpy as np
            from matplotlib.figure import Figure

            stats = {m: tables[m].activation_stats(sizes["activation_bytes"]) for m in ("dp", "cdp-v2")}
            for m, st in stats.items():
                print(f"{m:>7}: all workers peak {st['total_peak_bytes'] / 2**20:.2f} MiB, mean "
                      f"{st['total_mean_bytes'] / 2**20:.2f} MiB; busiest device {st['device_peak_bytes'] / 2**20:.2f} MiB")
            print(f"cdp-v2 / dp peak, in bytes: {stats['cdp-v2']['total_peak_bytes'] / stats['dp']['total_peak_bytes']:.2f} "
                  f"(unit model: {stats['cdp-v2']['total_peak'] / stats['dp']['total_peak']:.2f})")

            fig = Figure(figsize=(7, 3.2))
            ax = fig.add_subplot()
            for m in ("dp", "cdp-v2"):
                b = tables[m].activation_bytes(sizes["activation_bytes"]).sum(1) / 2**20
                ax.step(np.arange(len(b)), b, where="post", label=f"{m} (peak {b.max():.2f} MiB)")
            ax.set(xlabel="time step (tick)", ylabel="activations held, all workers (MiB)")
            ax.legend(fontsize=8)
            path = os.path.join(FIGURES, "activation_bytes_over_time.png")
            fig.savefig(path, bbox_inches="tight", dpi=120)
            display(Image(path))
        """)),
        new_markdown_cell("## Communication per time step"),
        new_code_cell(_src("""
            for m, t in tables.items():
                print(f"{m:>7}: busiest tick / mean tick = {t.comm_balance(sizes['param_bytes']):.2f}")
            path = plotting.plot_comm([tables["dp"], tables["cdp-v2"]], sizes["param_bytes"],
                                      os.path.join(FIGURES, "comm_per_tick.png"))
            display(Image(path))
        """)),
        new_markdown_cell(_src("""
            ## Measured: the compiled steps

            Per device: temporaries and arguments of the compiled train step (XLA memory analysis)
            beside the memory model (what the method must hold), and the bytes each worker really
            sends per step (each transfer as often as it runs). DP's gradients travel as one
            all-reduce; CDP's as collective-permutes of one stage each (point-to-point), DP's bytes
            in small messages spread over the step.
        """)),
        new_code_cell(_src("""
            records = {m: bench.bench_method(c, devices_for(c), repeats=2) for m, c in PLAN.items()}
            print(bench.format_table(list(records.values())))
            for m, r in records.items():
                model = r["memory_model"]
                print(f"{m:>7}: sent {r['sent_bytes_per_device_per_step'] / 2**20:.2f} MiB per worker per step; "
                      f"arguments {r['memory']['argument_bytes'] / 2**20:.1f} MiB (model "
                      f"{model['arguments']['total'] / 2**20:.1f})")

            kinds = ("all-reduce", "collective-permute")
            fig = Figure(figsize=(9, 3.2))
            ax, mem = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
            x = np.arange(len(kinds))
            for n, (m, r) in enumerate(records.items()):
                ax.bar(x + (n - 0.5) * 0.4, [r["sent_bytes_by_kind"][k] / 2**20 / r["devices"] for k in kinds], 0.4,
                       label=m)
            ax.set(xticks=x, xticklabels=kinds, ylabel="MiB per worker per step", title="bytes sent (HLO)")
            ax.legend(fontsize=8)
            mem.bar(list(records), [r["memory"].get("temp_bytes", 0) / 2**20 for r in records.values()])
            mem.set(ylabel="MiB", title="temporaries per device (XLA)")
            path = os.path.join(FIGURES, "measured_memory_and_collectives.png")
            fig.savefig(path, bbox_inches="tight", dpi=120)
            display(Image(path))
        """)),
    ]


def accuracy():
    name = "cdp_accuracy.ipynb"
    return name, [
        new_markdown_cell(_src(f"""
            # Accuracy curves: DP, CDP-v1, CDP-v2

            {badge(name)}

            Reproduces the accuracy figure of *Cyclic Data Parallelism* (arXiv 2403.08837), whose claim
            is that despite the gradient delay CDP-v1 and CDP-v2 reach DP's accuracy at the end of a
            full training run (about 95% on CIFAR-10 after 101 epochs). The tiny run here is far too
            short to show that: after 150 steps on digits the CDP runs end 3 to 5 points behind DP
            (measured here; the delay slows the first steps most); the training cell prints the gap.

            - GPU-sized config: `cdp_cifar10` (ResNet-18, CIFAR-10, 8 workers, global batch 512, SGD
              0.05, step decay) for `EPOCHS` epochs (the paper: 101). With fewer than 8 devices the CDP
              rules run as `cdp_impl='simulate'` (same updates, workers simulated on the devices there are).
            - Tiny config (`TINY = True`): `digits` (4-stage MLP, 8 workers on 8 simulated CPU devices),
              150 steps per method.

            How long: the tiny config took 2.5 to 4 minutes on this project's 2-core CPU machine
            (measured twice, the machine shared with other work). The GPU-sized config on a Colab T4: about
            an hour for the three methods at 30 epochs (an estimate from ResNet-18's FLOPs, not a
            measurement).

            Runs go to `runs/<method>/` (`RUNS`, set in its cell: Colab wipes `/content` when the runtime is
            recycled, `DRIVE = True` keeps them on Google Drive) and resume from their last checkpoint when
            the cell is rerun.
        """)),
        new_code_cell(INSTALL),
        new_code_cell(SETUP),
        new_code_cell(RUNS_CELL),
        new_code_cell(CONFIGS),
        new_code_cell(PREPARE_CIFAR),
        new_code_cell(_src("""
            METHODS = ("dp", "cdp-v1", "cdp-v2")
            EPOCHS = 30  # GPU-sized config; 101 reproduces the paper's run
            TINY_STEPS = 150


            def make_config(method):
                if TINY:
                    c = load_config(f"digits:method={method},steps={TINY_STEPS}")
                    c.eval_every, c.checkpoint_every = TINY_STEPS // 10, 0
                    return c
                c = load_config(f"cdp_cifar10:model=resnet18,method={method},epochs={EPOCHS}")
                if jax.device_count() < 8 and method != "dp":
                    c.cdp_impl = "simulate"
                if jax.device_count() < 8:
                    c.mesh = {"data": -1}
                return c


            # What the next cell trains, each on devices_for(config).
            PLAN = {method: make_config(method) for method in METHODS}
        """)),
        new_code_cell(_src("""
            from cdpjax import train

            summaries = {}
            for method, config in PLAN.items():
                summaries[method] = train.train(config, os.path.join(RUNS, method), progress=not TINY,
                                                devices=devices_for(config))
                print(f"{method:>7}: test accuracy {summaries[method]['test_accuracy']:.4f} after "
                      f"{summaries[method]['steps']} steps")
            for method in METHODS[1:]:
                gap = 100 * (summaries[method]["test_accuracy"] - summaries["dp"]["test_accuracy"])
                print(f"{method} - dp: {gap:+.1f} points")
        """)),
        new_code_cell(METRICS),
        new_code_cell(_src("""
            from matplotlib.figure import Figure

            fig = Figure(figsize=(10, 3.4))
            acc, loss = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
            for method in METHODS:
                metrics = read_metrics(os.path.join(RUNS, method))
                test = [m for m in metrics if m["split"] == "test"]
                trained = [m for m in metrics if m["split"] == "train"]
                acc.plot([m["step"] for m in test], [m["accuracy"] for m in test], marker="o", markersize=3,
                         label=method)
                loss.plot([m["step"] for m in trained], [m["loss"] for m in trained], label=method)
            acc.set(xlabel="step", ylabel="test accuracy", title="test accuracy")
            loss.set(xlabel="step", ylabel="train loss", yscale="log", title="train loss")
            acc.legend(fontsize=8)
            loss.legend(fontsize=8)
            path = os.path.join(FIGURES, "cdp_accuracy.png")
            fig.savefig(path, bbox_inches="tight", dpi=120)
            display(Image(path))
        """)),
    ]


def delays():
    name = "cdp_delays.ipynb"
    return name, [
        new_markdown_cell(_src(f"""
            # CDP under random delays: accuracy against the mean delay, with and without a correction

            {badge(name)}

            The CDP paper leaves open how cyclic training behaves when its fixed, uniform delay becomes
            random. Here each delay model is a time table (`cdpjax.layouts.delays`, method `cdp-random`):
            every (worker, stage) read takes a parameter version drawn from the model, and a correction
            (`cdpjax.delay_corrections`) may scale or compensate the stale update. tau = 0 is dp. The
            x-axis is the nominal mean delay (`at_mean_delay`); `experiments/delays.py` draws the same
            curves against the realised mean and over seeds (docs/delays.md).

            - Tiny config (`TINY = True`): `digits`, 4 workers and 4 stages simulated on one device,
              per-read delays uniform on {{0..2 tau}}, tau in (0, 2), without a correction and with the
              staleness-scaled learning rate, 60 steps a run.
            - GPU-sized config: the character language model (`charlm`), tau in (0, 1, 2, 4, 8), two
              delay models, no correction and three (nesterov left out: it diverges from a mean delay of 2
              on digits, docs/delays.md), 600 steps a run.

            How long: the tiny config is four short runs, a few minutes on this project's 2-core CPU
            machine (shared with other work when measured); the GPU-sized grid is 2 x 5 x 4 runs of the
            small language model (an estimate: about an hour on a Colab GPU, not measured).

            Runs go to `runs/<model>-tau<tau>-<correction>/` (`RUNS`, set in its cell: Colab wipes `/content`
            when the runtime is recycled, `DRIVE = True` keeps them on Google Drive) and resume when the cell
            is rerun.
        """)),
        new_code_cell(INSTALL),
        new_code_cell(SETUP),
        new_code_cell(RUNS_CELL),
        new_code_cell(CONFIGS),
        new_code_cell(_src("""
            from cdpjax.layouts.delays import at_mean_delay

            WORKERS = STAGES = 4
            if TINY:
                TASK, STEPS, MODELS, TAUS = "digits", 60, ("uniform-tau",), (0, 2)
                CORRECTIONS = ("none", "staleness-lr")
            else:
                TASK, STEPS, MODELS, TAUS = "charlm", 600, ("uniform-tau", "geometric"), (0, 1, 2, 4, 8)
                CORRECTIONS = ("none", "staleness-lr", "dc-asgd", "pipenag")


            def make_config(model, tau, correction):
                c = load_config(f"{TASK}:method=cdp-random,steps={STEPS}")
                c.cdp_impl, c.workers, c.stages, c.mesh = "simulate", WORKERS, STAGES, {"data": 1}
                c.eval_every, c.checkpoint_every = STEPS // 4, 0
                c.delay.update({**at_mean_delay(model, tau, STAGES), "correction": correction})
                return c


            def run_name(model, tau, correction):
                return f"{model}-tau{tau}-{correction}"


            # What the next cell trains, each on devices_for(config) (one device: the workers are simulated).
            PLAN = {run_name(model, tau, correction): make_config(model, tau, correction)
                    for model in MODELS for tau in TAUS for correction in CORRECTIONS}
        """)),
        new_code_cell(_src("""
            from cdpjax import train

            summaries = {}
            for name, config in PLAN.items():
                summaries[name] = train.train(config, os.path.join(RUNS, name), progress=not TINY,
                                              devices=devices_for(config))
                print(f"{name:>32}: test loss {summaries[name]['test_loss']:.4f}")
        """)),
        new_code_cell(_src("""
            from matplotlib.figure import Figure

            HEADLINE = "test_accuracy" if TASK == "digits" else "test_loss"
            fig = Figure(figsize=(4.2 * len(MODELS), 3.4))
            for k, model in enumerate(MODELS):
                ax = fig.add_subplot(1, len(MODELS), k + 1)
                for correction in CORRECTIONS:
                    ax.plot(TAUS, [summaries[run_name(model, tau, correction)][HEADLINE] for tau in TAUS],
                            marker="o", label=correction)
                ax.set(xlabel="nominal mean delay tau", ylabel=HEADLINE.replace("_", " "), title=model)
                ax.legend(fontsize=8, title="correction")
            path = os.path.join(FIGURES, "cdp_delays.png")
            fig.savefig(path, bbox_inches="tight", dpi=120)
            display(Image(path))
        """)),
    ]


def ppll():
    name = "ppll_vs_local_gpipe.ipynb"
    return name, [
        new_markdown_cell(_src(f"""
            # PPLL against local learning and GPipe: speedup and accuracy

            {badge(name)}

            Reproduces the claims of *PPLL* (Guo et al., arXiv 2411.12780): pipelining local learning
            over K devices trains faster than sequential local learning (their 4 GPUs: 1.33x for
            ResNet, 2.62x for ViT) at the accuracy of local learning (here: exactly, since `ppll`'s
            parameters after T batches equal `local`'s), against GPipe and plain model parallelism.

            - GPU-sized config: `ppll_resnet32` (ResNet-32, CIFAR-10, PPLL's heads, K = 4) for `EPOCHS`
              epochs (the paper: 400). On fewer than K GPUs (Colab: one) `ppll` trains with its K modules
              grouped on the GPUs there are (all on one: PPLL's updates without its overlap); `gpipe` needs
              K devices, and with fewer its speed is predicted only.
            - Tiny config (`TINY = True`): `digits` (4-stage MLP, K = 4 on 8 simulated CPU devices),
              150 steps per method; on fewer than K devices (a one-GPU runtime) `ppll` and `gpipe` are
              predicted only.

            How long: the tiny config took 2 to 3.5 minutes on this project's 2-core CPU machine
            (measured twice, the machine shared with other work). The GPU-sized config on a Colab T4: about
            30 to 45 minutes for e2e, local and ppll at 40 epochs (an estimate from the model's FLOPs,
            not a measurement).

            Speedup on K devices is predicted by `cdpjax.speedup` from per-stage times measured on one
            device (assumptions in its docstring); times measured on simulated CPU devices share the
            same cores and show the framework's overhead, not a speedup.

            Runs go to `runs/<method>/` (`RUNS`, set in its cell: Colab wipes `/content` when the runtime is
            recycled, `DRIVE = True` keeps them on Google Drive) and resume from their last checkpoint when
            the cell is rerun.
        """)),
        new_code_cell(INSTALL),
        new_code_cell(SETUP),
        new_code_cell(RUNS_CELL),
        new_code_cell(CONFIGS),
        new_code_cell(PREPARE_CIFAR),
        new_code_cell(_src("""
            from cdpjax import methods
            from cdpjax.layouts import mesh_for

            K = 4
            EPOCHS = 40  # GPU-sized config; 400 reproduces the paper's run
            TINY_STEPS = 150
            METHODS = [m for m in ("e2e", "local", "ppll", "gpipe") if m in methods.REGISTRY]


            def make_config(method, microbatches=None, devices=None):
                # devices: the GPUs PPLL's K modules are grouped on (GPU-sized config; default K, one module
                # each); gpipe keeps one module per device.
                if TINY:
                    c = load_config(f"digits:method={method},stages={K},steps={TINY_STEPS}")
                    c.eval_every, c.checkpoint_every = TINY_STEPS // 10, 0
                else:
                    grouped = f",devices={devices}" if devices and method != "gpipe" else ""
                    c = load_config(f"ppll_resnet32:K={K},method={method},epochs={EPOCHS}{grouped}")
                if microbatches is not None:
                    c.microbatches = microbatches
                return c


            # On fewer GPUs than K (Colab: one), ppll's K modules share the GPUs there are (all on one: the
            # same updates, without the pipeline's overlap); gpipe needs K and is then predicted only, as is
            # the tiny config's ppll (its K modules are not grouped).
            DEVICES = min(K, jax.device_count())
            PLAN = {}  # what the next cell trains, each on devices_for(config)
            for method in METHODS:
                config = make_config(method, devices=DEVICES)
                if fits(config):
                    PLAN[method] = config
                else:
                    print(f"{method:>6}: its mesh {mesh_for(config)} does not fit {jax.device_count()} device(s) here: "
                          f"not trained (speed predicted below)")
        """)),
        new_code_cell(_src("""
            from cdpjax import train

            summaries = {}
            for method, config in PLAN.items():
                summaries[method] = train.train(config, os.path.join(RUNS, method), progress=not TINY,
                                                devices=devices_for(config))
                print(f"{method:>6}: test accuracy {summaries[method]['test_accuracy']:.4f}, "
                      f"{summaries[method]['images_per_second']:.0f} images/s here")
        """)),
        new_markdown_cell(_src("""
            ## Speedup on K devices (predicted) and here (measured)

            Predicted: `ppll`, `gpipe` with M = 4 micro-batches, and plain model parallelism (gpipe with
            M = 1, PPLL's "conventional pipeline"), each against the same work on one device.
        """)),
        new_code_cell(_src("""
            import numpy as np
            from matplotlib.figure import Figure

            from cdpjax import speedup

            BANDWIDTH = 100e9  # bytes/s between devices (NVLink-class)
            predicted = {}
            for label, method, mb in (("ppll", "ppll", None), ("gpipe M=4", "gpipe", 4), ("model parallel", "gpipe", 1)):
                p = speedup.predict_for_config(make_config(method, mb), K, BANDWIDTH)
                if "error" in p:
                    print(f"{label}: {p['error']}")
                    continue
                predicted[label] = p["speedup"]
                print(f"{label:>15}: predicted {p['speedup']:.2f}x on {K} devices "
                      f"(stage imbalance {p['imbalance']:.2f})")
            if "model parallel" in predicted:
                print(f"ppll / model parallel: {predicted['ppll'] / predicted['model parallel']:.2f} "
                      f"(PPLL's claim on 4 GPUs: 0.85 for ResNet, 1.25 for ViT)")
            here = {m: s["images_per_second"] / summaries["local"]["images_per_second"]
                    for m, s in summaries.items() if "local" in summaries}

            fig = Figure(figsize=(10, 3.4))
            ax, meas = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
            ax.bar(list(predicted), list(predicted.values()), color=["C1", "C2", "C3"][:len(predicted)])
            ax.axhline(K, color="grey", linestyle="--", linewidth=0.8, label=f"K = {K}")
            ax.set(ylabel="speedup over one device", title=f"predicted on {K} devices")
            ax.legend(fontsize=8)
            meas.bar(list(here), list(here.values()))
            meas.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
            meas.set(ylabel="images/s over local", title="measured here" + (" (simulated devices)" if not ACCELERATOR else ""))
            path = os.path.join(FIGURES, "ppll_speedup.png")
            fig.savefig(path, bbox_inches="tight", dpi=120)
            display(Image(path))
        """)),
        new_markdown_cell("## Accuracy"),
        new_code_cell(METRICS),
        new_code_cell(_src("""
            fig = Figure(figsize=(10, 3.4))
            bars, curves = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
            bars.bar(list(summaries), [s["test_accuracy"] for s in summaries.values()],
                     color=[f"C{n}" for n in range(len(summaries))])
            low = min(s["test_accuracy"] for s in summaries.values())
            bars.set(ylabel="test accuracy", title=f"after training, K = {K}", ylim=(max(0.0, low - 0.1), 1.0))
            for method in summaries:
                test = [m for m in read_metrics(os.path.join(RUNS, method)) if m["split"] == "test"]
                curves.plot([m["step"] for m in test], [m["accuracy"] for m in test], marker="o", markersize=3,
                            label=method)
            curves.set(xlabel="step", ylabel="test accuracy", title="test accuracy")
            curves.legend(fontsize=8)
            path = os.path.join(FIGURES, "ppll_accuracy.png")
            fig.savefig(path, bbox_inches="tight", dpi=120)
            display(Image(path))
            if {"local", "ppll"} <= set(summaries):
                print(f"local {summaries['local']['test_accuracy']:.4f}, ppll {summaries['ppll']['test_accuracy']:.4f} "
                      f"(equal by construction: the same updates in a pipeline)")
        """)),
    ]


NOTEBOOKS = (timing_diagrams, memory_and_communication, accuracy, delays, ppll)


def build(make) -> tuple[str, nbformat.NotebookNode]:
    name, cells = make()
    for number, cell in enumerate(cells):
        cell.id = f"cell-{number}"  # nbformat's default is random: every regeneration rewrote every notebook
    nb = new_notebook(cells=cells)
    nb.metadata.update({
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "accelerator": "GPU",  # Colab opens it on a GPU runtime
        "colab": {"provenance": []},
    })
    return name, nb


def main() -> None:
    for make in NOTEBOOKS:
        name, nb = build(make)
        nbformat.validate(nb)
        nbformat.write(nb, os.path.join(HERE, name))
        print(os.path.join("colab", name))


if __name__ == "__main__":
    main()
