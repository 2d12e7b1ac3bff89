"""What the method tests share: a small config, a method built on the first devices, batches, a
runner that trains S steps and flushes, and tree comparisons (chex).

Every helper takes what it needs as arguments (no module state but the cached digits batches),
so that a test reads as its claim: build two methods, run both on the same batches, compare.
"""
import functools
import importlib.util
import math
import sys

import chex
import jax
import numpy as np

from cdpjax import data, methods
from cdpjax.config import default_config
from cdpjax.mesh import make_mesh

DIGITS_SHAPE, DIGITS_CLASSES = (8, 8, 1), 10


def small_config(method: str = "e2e", model: str = "mlp", **overrides):
    """`default_config()` made small: digits, `model` (an MLP 16 wide by default), no
    normalisation (exact equalities; a test that wants BatchNorm says `norm='batch'`), no
    evaluation or checkpoints, 20 steps for the schedule. `overrides` set any key, types
    unchecked (`stages` may be a list of split points)."""
    c = default_config()
    c.method, c.model, c.norm = method, model, "none"
    c.model_kwargs = {"width": 16} if model == "mlp" else {}
    c.num_steps, c.eval_every, c.checkpoint_every = 20, 0, 0
    with c.ignore_type():
        for k, v in overrides.items():
            c[k] = v
    return c


def context(config, mesh_axes: dict, image_shape=DIGITS_SHAPE, num_classes=DIGITS_CLASSES) -> methods.Context:
    """A builder's context: `config` on a mesh of the first devices (as many as `mesh_axes` multiply to)."""
    n = math.prod(mesh_axes.values())
    return methods.Context(config, make_mesh(dict(mesh_axes), jax.devices()[:n]), tuple(image_shape), num_classes)


def build(config, mesh_axes: dict, image_shape=DIGITS_SHAPE, num_classes=DIGITS_CLASSES):
    """`config`'s method on a mesh of the first devices (as many as `mesh_axes` multiply to)."""
    return methods.build(context(config, mesh_axes, image_shape, num_classes))


def random_batches(count: int, batch: int, image_shape=DIGITS_SHAPE, num_classes=DIGITS_CLASSES, seed: int = 0):
    """`count` batches of normal images and uniform labels (seeded)."""
    rng = np.random.default_rng(seed)
    return [{"image": rng.normal(size=(batch, *image_shape)).astype(np.float32),
             "label": rng.integers(0, num_classes, batch).astype(np.int32)} for _ in range(count)]


@functools.lru_cache(maxsize=None)
def digits_batches(count: int, batch: int) -> tuple:
    """The first `count` batches of the digits training stream (seed 0, no augmentation)."""
    ds = data.build(default_config())
    return tuple(ds.train_batch(k, batch, 0, augment=False) for k in range(count))


def run(method, batches, state=None, flush: bool = True):
    """`method` trained on `batches` (one step each, every loss finite) from `state` (default:
    `init` with key 0), then flushed if it has a flush and `flush` is set: the state after
    every batch fed has been trained on."""
    state = method.init(jax.random.key(0)) if state is None else state
    for b in batches:
        state, metrics = method.train_step(state, b)
        assert np.isfinite(float(metrics["loss"])), metrics
    if flush and method.flush is not None:
        state = method.flush(state)
    return state


def params(method, state):
    """The exported per-stage parameters, on the host."""
    return jax.device_get(method.export(state)[0])


def assert_trees_close(actual, expected, atol: float = 1e-5, rtol: float = 1e-5):
    """Same tree structure, at least one leaf, every leaf close (`chex.assert_trees_all_close`)."""
    actual, expected = jax.device_get(actual), jax.device_get(expected)
    assert jax.tree.leaves(expected), "nothing to compare: the expected tree has no leaves"
    chex.assert_trees_all_close(actual, expected, atol=atol, rtol=rtol)


def assert_trees_equal(actual, expected):
    """Same tree structure, at least one leaf, every leaf bit for bit (`chex.assert_trees_all_equal`)."""
    actual, expected = jax.device_get(actual), jax.device_get(expected)
    assert jax.tree.leaves(expected), "nothing to compare: the expected tree has no leaves"
    chex.assert_trees_all_equal(actual, expected)


def max_diff(a, b) -> float:
    """The largest absolute difference between two trees of the same structure."""
    chex.assert_trees_all_equal_structs(jax.device_get(a), jax.device_get(b))
    pairs = zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)))
    return max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max()) for x, y in pairs)


# ------------------------------------------------------------------ CDP's timing, written out


def cdp_rule(method: str, workers: int, stages: int, steps: int, ticks: str = "whole"):
    """CDP's (and dp's) schedule as the paper states it, written out here without the table code.
    A step's ops at their phases (ticks from the step's start): 'whole' (T = 2L): the forward of
    stage j at phase j, its backward at 2L-1-j, which completes the stage's gradient; 'split'
    (T = 3L): forwards at j, then stage j's input backward B at L + 2(L-1-j) and its weight
    gradient W, which completes the gradient, one tick later; 'paired' (T = ceil(L/2) + L): the
    forward of stage j at phase j // 2 (two stages a tick), its backward at ceil(L/2) + L-1-j.
    Worker i starts step k at tick o_i + Tk with o_i = T*i/N (dp: every worker at Tk). Stage j's
    update for step k lands at the end of the last worker's gradient op of stage j (dp: the
    step's last tick, after the all-reduce); g_j is that op's phase. cdp-v1 reads the previous
    version everywhere; cdp-v2 where the forward comes before the previous step's update:
    o_i + f_j <= o_{N-1} + g_j - T (f_j the forward's phase). Version read at step k: k, or
    max(k-1, 0) when stale; slot 'current' iff that version is the number of updates of the
    stage applied before the tick.

    Returns (ops, updates, stale): ops as {(tick, worker, stage, kind, step, version, slot, stale)},
    updates as {(tick, stage, step)}, stale as an [N, L] bool array."""
    N, L = workers, stages
    if ticks == "whole":
        T, phases = 2 * L, [(j, "F", j) for j in range(L)] + [(2 * L - 1 - j, "B", j) for j in range(L)]
    elif ticks == "split":
        T = 3 * L
        phases = [(j, "F", j) for j in range(L)] + [(L + 2 * (L - 1 - j) + w, kind, j) for j in range(L)
                                                    for w, kind in ((0, "B"), (1, "W"))]
    else:
        half = -(-L // 2)
        T, phases = half + L, [(j // 2, "F", j) for j in range(L)] + [(half + L - 1 - j, "B", j) for j in range(L)]
    gradient = "W" if ticks == "split" else "B"
    f = {j: p for p, kind, j in phases if kind == "F"}
    g = {j: p for p, kind, j in phases if kind == gradient}
    offset = [0 if method == "dp" else T * i // N for i in range(N)]
    stale = np.array([[method == "cdp-v1" or (method == "cdp-v2" and offset[i] + f[j] <= offset[-1] + g[j] - T)
                       for j in range(L)] for i in range(N)])
    update_tick = {(j, k): T * k + T - 1 if method == "dp" else offset[-1] + T * k + g[j]
                   for j in range(L) for k in range(steps)}
    ops = set()
    for k in range(steps):
        for i in range(N):
            for p, kind, j in phases:
                tick = offset[i] + T * k + p
                version = max(k - int(stale[i, j]), 0)
                applied = sum(1 for s in range(steps) if update_tick[(j, s)] < tick)
                ops.add((tick, i, j, kind, k, version, "current" if version == applied else "previous",
                         bool(stale[i, j])))
    updates = {(tick, j, k) for (j, k), tick in update_tick.items()}
    return ops, updates, stale


# ------------------------------------------------------------------ figures, read back


def capture_figures(monkeypatch, *modules, into=None) -> list:
    """Wraps each module's `_save(fig, path)` (cdpjax.plotting's, reproduce.py's): every figure
    saved is recorded as (path, Figure) and still written, to `path` or, with `into`, to the
    file of the same name in that directory. Returns the (growing) list."""
    import os

    saved = []
    for module in modules:
        def save(fig, path, real=module._save):
            target = os.path.join(into, os.path.basename(path)) if into is not None else path
            saved.append((str(path), fig))
            real(fig, target)
            return path

        monkeypatch.setattr(module, "_save", save)
    return saved


def schedule_boxes(fig) -> list:
    """The ops a timing diagram (`plotting.plot_schedule`) draws: (tick, stage, label, hatched) per
    box, a box being a rectangle with its text at its centre."""
    from matplotlib.patches import Rectangle

    (ax,) = fig.axes
    texts = {(round(t.get_position()[0], 6), round(t.get_position()[1], 6)): t.get_text() for t in ax.texts}
    boxes = []
    for r in ax.patches:
        if isinstance(r, Rectangle):
            x, y, w, h = r.get_x(), r.get_y(), r.get_width(), r.get_height()
            label = texts[(round(x + w / 2, 6), round(y + h / 2, 6))]
            boxes.append((int(round(x)), int(round(y + h / 2)), label, bool(r.get_hatch())))
    return boxes


def update_marks(fig) -> list:
    """(x, stage) of every update mark ('|') of a timing diagram."""
    (ax,) = fig.axes
    return [tuple(int(round(v)) for v in line.get_xydata()[0]) for line in ax.get_lines() if line.get_marker() == "|"]


def line_data(ax) -> list:
    """[(x, y)] of every line of an axes, as lists, in drawing order."""
    return [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]


def png_matches(path, fig, dpi: int = 120) -> bool:
    """The file is a PNG of this figure's proportions at `dpi` (within the tight bounding box's
    trim) with lines and text on it, not a blank page."""
    from PIL import Image

    image = Image.open(path)
    width, height = fig.get_size_inches() * dpi
    if image.format != "PNG" or not (0.6 * width < image.size[0] < 1.4 * width + 300):
        return False
    if not 0.6 * height < image.size[1] < 1.4 * height + 100:
        return False
    rgb = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(np.int64)
    return len(np.unique(rgb @ np.array([1 << 16, 1 << 8, 1]))) > 10


def same_pixels(a, b) -> bool:
    """Two image files with the same pixels."""
    from PIL import Image

    pa, pb = (np.asarray(Image.open(p).convert("RGBA")) for p in (a, b))
    return pa.shape == pb.shape and bool((pa == pb).all())


def load_script(path, name: str):
    """An experiment script (`experiments/*.py`, not a package) imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
