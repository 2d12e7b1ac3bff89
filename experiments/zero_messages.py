"""cdp-zero's messages per period: collective-permutes in the compiled step against one per piece.

    python experiments/zero_messages.py --devices 2,4,8 --stages 16

For each worker count N (its own process), the digits MLP cut into `stages` stages, cdp-zero on N
devices: the collective-permutes in the compiled step (a tick's pieces batched, one per phase,
route and payload length), the permutes one per piece would take ((N - 1) per visit and per
gradient op, as before the batching), the bytes the compiled permutes send per device and step
against the bytes the program declares (equal: nothing is padded), and the bytes a batching
padded to one message per route and tick would send. Compiled only.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys


def one(devices: int, stages: int) -> dict:
    from cdpjax import mesh as mesh_lib

    mesh_lib.setup_devices(devices)
    import jax

    from cdpjax import bench
    from cdpjax.config import default_config
    from cdpjax.program.zero import zero_program_period

    c = default_config()
    c.method, c.stages = "cdp-zero", stages
    c.model_kwargs.depth = stages - 1  # the mlp: a stage per block
    c.global_batch_size = 2 * devices
    c.eval_every = c.checkpoint_every = 0
    run = bench._prepare(c, jax.devices()[:devices])
    m, hlo = run["method"], run["compiled"].as_text()
    permutes = sum(bool(re.search(r"\scollective-permute(-start)?\(", line.split("=", 1)[1]))
                   for line in hlo.splitlines() if "=" in line)
    z, N = zero_program_period(m.program), devices
    stage = _stage_sizes(m)
    piece = [-(-s // N) for s in stage]
    per_piece = sum((N - 1) * (len(tk.gathers) + sum(op.gradient for op in tk.ops)) for tk in z.ticks)
    padded = 0
    for tk in z.ticks:
        for pairs in (_pairs([(u, g.worker, g.stage) for g in tk.gathers for u in range(N) if u != g.worker], piece),
                      _pairs([(op.worker, u, op.stage) for op in tk.ops if op.gradient for u in range(N)
                              if u != op.worker], piece)):
            routes = {}
            for (src, dst), size in pairs.items():
                routes.setdefault((dst - src) % N, []).append(size)
            padded += sum(len(sizes) * max(sizes) for sizes in routes.values())
    declared = float(m.program.sent_bytes({"param": [4 * s for s in stage]}).mean())
    sent = bench.traffic(hlo, N)["by_kind"]["collective-permute"] / N
    return {"devices": N, "stages": stages, "permutes": permutes, "per_piece": per_piece,
            "sent_bytes": sent, "declared_bytes": declared, "padded_bytes": 4 * padded / N}


def _stage_sizes(m) -> list[int]:
    import jax

    shapes = jax.eval_shape(lambda: m.net.init(jax.random.key(0)))[0]
    return [sum(x.size for x in jax.tree.leaves(p)) for p in shapes]


def _pairs(pieces, piece) -> dict:
    out = {}
    for src, dst, stage in pieces:
        out[(src, dst)] = out.get((src, dst), 0) + piece[stage]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.stages)))
        return
    print("| N | L | permutes, batched | one per piece | bytes sent / device / step | declared "
          "| padded to one per route |")
    print("|---|---|---|---|---|---|---|")
    for d in (int(x) for x in args.devices.split(",")):
        done = subprocess.run([sys.executable, __file__, "--one", str(d), "--stages", str(args.stages)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {r['devices']} | {r['stages']} | {r['permutes']} | {r['per_piece']} | {r['sent_bytes']:.0f} | "
              f"{r['declared_bytes']:.0f} | {r['padded_bytes']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
