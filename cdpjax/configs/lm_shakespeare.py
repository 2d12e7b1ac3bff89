"""A GPU-sized character-level GPT on tensorflow-datasets' tiny_shakespeare (prepared beforehand).

nanoGPT's "baby GPT" sizes (karpathy/nanoGPT, config/train_shakespeare_char.py): 6 causal
blocks, 384 wide, 6 heads, MLP 1536, windows of 256 characters, batch 64 windows (16,384
tokens), AdamW 1e-3 (weight decay 0.1) with 100 warm-up steps and a cosine schedule, 5,000
steps, computing in bfloat16. The model is cut into `stages` stages for the pipelines and
local learning (4 by parameters: the 8 blocks [embedding, 6 decoder blocks, head]).

The data: tiny_shakespeare's 'train' split (1,003,854 characters; a window at every
position) and its 'test' split (55,770; windows side by side), 65 characters. Prepare it
once where TensorFlow and the internet are (cdpjax/data/tfds_text.py; `cdpjax train`
says the command if it is missing), then point --config.data_dir at it:

    cdpjax train --config lm_shakespeare:method=dp --config.data_dir=DIR
    cdpjax train --config lm_shakespeare:method=e2e,steps=2000 --config.data_dir=DIR

Hardware: one GPU (e2e) or one per data-parallel worker (dp). Expected: not measured here
yet (no GPU run of this file so far). The reference: nanoGPT's model of these sizes, with
dropout 0.2 (which `gpt` does not have) and its own 90/10 split, reaches a best
validation loss of 1.4697 per character on one A100 in about 3 minutes; without dropout
expect the test loss to reach its lowest well before 5,000 steps and then rise (overfitting):
the test lines every 250 steps show where.
"""
from cdpjax.config import default_config, parse_arg


def get_config(arg=None):
    a = parse_arg(arg, method="dp", stages=4, steps=5000)
    c = default_config()
    c.method = a["method"]
    c.model = "gpt"
    c.model_kwargs = {"width": 384, "depth": 6, "heads": 6, "mlp_dim": 1536}
    c.dtype = "bfloat16"
    c.dataset = "tiny_shakespeare"
    c.dataset_kwargs = {"window": 256, "level": "char"}
    c.stages = a["stages"]
    c.global_batch_size = 64
    c.num_steps = a["steps"]
    c.eval_every = 250
    c.checkpoint_every = 1000
    c.log_every = 50
    c.optimizer, c.learning_rate, c.weight_decay = "adamw", 1e-3, 0.1
    c.schedule, c.warmup_steps = "cosine", 100
    return c
