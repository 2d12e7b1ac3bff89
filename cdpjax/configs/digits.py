"""Digits (scikit-learn's 8x8 handwritten digits, embedded): every method, runs here in seconds.

Reproduces, in miniature, the CDP paper's claim that CDP-v1 / CDP-v2 train as well
as DP, and PPLL's claim that pipelined local learning equals sequential local
learning. 4-stage MLP, global batch 128, 600 steps (about 51 epochs).

    cdpjax train --config digits:method=cdp-v2
    cdpjax train --config digits:method=ppll

Expected: dp, cdp-v1, cdp-v2 about 97-98% test accuracy (within 1 point of each
other); e2e about 97-98%; local and ppll equal to each other and within 2 points
of e2e. `cdpjax train` with no arguments is this file with method=cdp-v2.
"""
from cdpjax.config import default_config, parse_arg


def get_config(arg=None):
    a = parse_arg(arg, method="cdp-v2", model="mlp", stages=4, steps=600)
    c = default_config()
    c.method = a["method"]
    c.model = a["model"]
    c.stages = a["stages"]
    c.num_steps = a["steps"]
    return c  # the mesh is the method's own (cdpjax.layouts): no per-method lists here
