"""Bring your own model: the lines that turn a plain PyTorch loop into a swarm member.

    python examples/bring_your_own/template.py            # 2 local peers, a toy regression

Marked with  # <-- swarm  below; everything else is your usual training code.
"""
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from local_swarm import run_local_swarm  # noqa: E402

from lioncub_p2p import LionCub  # noqa: E402  # <-- swarm
from lioncub_p2p.swarm import Swarm, snapshot  # noqa: E402  # <-- swarm


def my_training(peer: int, swarm: Swarm, steps: int = 150) -> tuple[float, bytes]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))  # your model
    true_w = torch.arange(8.0) / 8
    # optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)                          # before
    optimizer = LionCub(model.parameters(), lr=1e-2, weight_decay=0.0, aggregator=swarm)  # <-- swarm
    swarm.join(optimizer)  # <-- swarm: start the run, or download the swarm's state
    gen = torch.Generator().manual_seed(peer)
    while optimizer.step_count < steps:  # the global step, shared by all peers
        x = torch.randn(64, 8, generator=gen)
        loss = nn.functional.mse_loss(model(x).squeeze(1), x @ true_w)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item(), snapshot.params_digest(optimizer)


if __name__ == "__main__":
    results = run_local_swarm(2, my_training, run_id="byo-template")
    print(f"final losses {[round(r[0], 4) for r in results]}, identical parameters: {len({r[1] for r in results}) == 1}")
