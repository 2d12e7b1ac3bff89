"""Train the embedded digits MLP with a head and local loss of one's own (my_head.py, next to this file).

    cdpjax train --config experiments/own_head/config.py                 # ppll: 4 stages x 2 replicas on 8 devices
    cdpjax train --config experiments/own_head/config.py:method=local
    cdpjax describe --config experiments/own_head/config.py

`import my_head` works because cdpjax puts this file's folder on `sys.path` while it runs
(`cdpjax.config.load_file`); importing it registers the head kind "smooth_mlp" (a pooled
MLP trained on label-smoothed cross-entropy), which `config.aux_head` names and whose
options `config.aux_kwargs` sets.

Expected after 600 steps (any hardware): about 98% test accuracy for ppll and local alike
(ppll equals local), as the built-in heads reach on this model.
"""
import my_head  # noqa: F401 - registers the "smooth_mlp" head

from cdpjax.config import default_config, parse_arg


def get_config(arg=None):
    a = parse_arg(arg, method="ppll", steps=600, smoothing=0.1)
    c = default_config()
    c.method = a["method"]
    c.num_steps = a["steps"]
    c.aux_head = "smooth_mlp"
    c.aux_kwargs = {"hidden": 64, "smoothing": a["smoothing"]}
    return c
