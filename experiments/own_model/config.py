"""Train `my_cnn` (my_model.py, next to this file) on the embedded digits, with any method.

    cdpjax train --config experiments/own_model/config.py:method=cdp-v2
    cdpjax train --config experiments/own_model/config.py:method=ppll
    python experiments/own_model/train_from_python.py          # both, from Python

`import my_model` works because cdpjax puts this file's folder on `sys.path` while it
runs (`cdpjax.config.load_file`). No mesh and no method list here: each method runs on
the mesh its layout declares (`cdpjax.layouts`): cdp-v2 puts every device on `data`
(8 simulated CPU devices on a machine without GPUs), ppll one device per stage (4), with
pipeline replicas over `data` on the devices left (2 on 8).

Expected after 300 steps (any hardware): cdp-v2 about 98-99% test accuracy, ppll about
95% (local learning through linear auxiliary heads learns more slowly than end-to-end
training on this small model).
"""
import my_model  # noqa: F401 - registers "my_cnn"

from cdpjax.config import default_config, parse_arg


def get_config(arg=None):
    a = parse_arg(arg, method="cdp-v2", steps=300)
    c = default_config()
    c.method = a["method"]
    c.model = "my_cnn"
    c.model_kwargs = {"widths": (16, 32, 32)}
    c.norm = "group"
    c.stages = 4  # one block per stage: three ConvBlocks and the classifier
    c.num_steps = a["steps"]
    c.eval_every = c.checkpoint_every = 100
    return c
