"""Train the embedded digits MLP on a regression task of one's own (my_task.py, next to this file).

    cdpjax train --config experiments/own_task/config.py                  # ppll: 4 stages on 4 devices
    cdpjax train --config experiments/own_task/config.py:method=local
    cdpjax train --config experiments/own_task/config.py:method=cdp-v2    # any method

`import my_task` registers the task "ink" (squared error of one float output) and the dataset
"digits_ink" (each digit's ink as a float target); the dataset names its task, so no
`config.task` is needed. Local learning (`local`, `ppll`) trains every module's auxiliary
head (`greedy`: one output) on the task's own loss.

Expected (train MSE, every method, as tests/test_own_task.py drives them from Python on
this machine): below the targets' variance (0.11) within 200 steps: local about 0.03,
e2e about 0.01, cdp-v1 about 0.09 (its delayed gradients); from the command line as from
Python (tests/test_own_task.py runs the first command).
"""
import my_task  # noqa: F401 - registers the task "ink" and the dataset "digits_ink"

from cdpjax.config import default_config, parse_arg


def get_config(arg=None):
    a = parse_arg(arg, method="ppll", steps=200)
    c = default_config()
    c.method = a["method"]
    c.dataset = "digits_ink"
    c.model = "mlp"
    c.stages = 4
    c.num_steps = a["steps"]
    c.learning_rate = 0.005  # SGD with momentum 0.9: 0.02 diverges under cdp-v1's delayed gradients
    c.eval_every = c.checkpoint_every = 100
    return c
