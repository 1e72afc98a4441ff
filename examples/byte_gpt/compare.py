"""A byte-level GPT on the Python standard library's own sources: Lion Cub against full-precision Lion.

    python examples/byte_gpt/compare.py [--steps 200] [--workers 4] [--out runs/byte_gpt]

Four simulated workers each train on their own slice of the corpus. Full-precision (global) Lion
averages their gradients; Lion Cub lets them vote with 1-bit signs every step and averages momenta
every 10 steps. Same model, data, seed and steps; writes loss curves to a PNG and the numbers to JSON.
The same model trains in a real swarm with ``lioncub-train --task byte-gpt`` (lioncub_p2p/tasks/byte_gpt.py).
"""
import argparse
import json
from pathlib import Path

from lioncub_p2p.momentum import MomentumSchedule
from lioncub_p2p.sim.inprocess import Method, run_method
from lioncub_p2p.tasks.byte_gpt import stdlib_bytes_task


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="windows of 64 bytes per worker per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=Path("runs/byte_gpt"))
    args = parser.parse_args(argv)
    task = stdlib_bytes_task()
    methods = [Method("full-precision Lion (averaged gradients)"),
               Method("Lion Cub: 1-bit majority, momentum avg/10", "sign", "majority", MomentumSchedule(every=10))]
    outcomes = [run_method(m, task, workers=args.workers, steps=args.steps, batch=args.batch, lr=args.lr,
                           weight_decay=0.01) for m in methods]
    args.out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for o in outcomes:
        steps, losses = zip(*o.curve)
        smooth = [sum(losses[max(0, i - 9): i + 1]) / len(losses[max(0, i - 9): i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, label=f"{o.method} (test {o.test_accuracy:.2f} bits/byte)")
    ax.set(xlabel="step", ylabel="train loss, nats/byte (smoothed)", title="byte GPT on the Python stdlib")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "loss.png", dpi=110)
    result = {o.method: {"test_loss_nats": o.test_loss, "test_bits_per_byte": o.test_accuracy,
                         "wire_bits_per_param_step": o.bits_per_element_per_step} for o in outcomes}
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    for name, r in result.items():
        print(f"{name}: test {r['test_bits_per_byte']:.3f} bits/byte, {r['wire_bits_per_param_step']:.1f} bits/param/step")
    print(f"plot: {args.out / 'loss.png'}")
    return result


if __name__ == "__main__":
    main()
