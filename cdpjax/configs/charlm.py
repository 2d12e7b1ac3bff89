"""A character-level GPT on the embedded corpus (Shakespeare's Coriolanus, 61 symbols), on a CPU.

The language-modelling counterpart of digits.py: a 4-block causal transformer
(64 wide, 4 heads, MLP 256) reads windows of 32 characters and predicts the next
character at every position (task `language_modelling`: per-token cross-entropy).
Adam 3e-3 with a cosine schedule, global batch 64 windows (2,048 tokens), 300
steps (about 0.14 epochs of the 139k training windows); the model is cut into
`stages` stages (4: [embedding + block], [block], [block], [block + head]).

    cdpjax train --config charlm:method=e2e
    cdpjax train --config charlm:method=dp

Expected (measured on this project's shared 2-core CPU machine; dp on 8 simulated
devices): per-token test loss 4.12 at initialisation (about log 61 = 4.11), 2.52
after 100 steps, 2.25 after 300 (test perplexity 9.5, token accuracy 0.34), e2e
and dp equal to 6 digits (dp is e2e's update rule); a run took about a minute
there, compilation included. metrics.jsonl's lines carry `loss` (per token, nats),
`perplexity`, `token_accuracy` and `tokens_per_second`.
Methods other than e2e and dp take their loss from the task once their runtimes
do (docs/language_model.md says which do).
"""
from cdpjax.config import default_config, parse_arg


def get_config(arg=None):
    a = parse_arg(arg, method="dp", stages=4, steps=300, window=32)
    c = default_config()
    c.method = a["method"]
    c.model = "gpt"
    c.model_kwargs = {"width": 64, "depth": 4, "heads": 4, "mlp_dim": 256}
    c.dataset = "coriolanus"
    c.dataset_kwargs = {"window": a["window"]}
    c.stages = a["stages"]
    c.global_batch_size = 64
    c.num_steps = a["steps"]
    c.eval_every = c.checkpoint_every = 100
    c.log_every = 20
    c.optimizer, c.learning_rate, c.weight_decay = "adam", 3e-3, 0.0
    c.schedule = "cosine"
    c.aux_head = "token_linear"  # local, ppll: a per-token linear head on each module's tokens
    return c
