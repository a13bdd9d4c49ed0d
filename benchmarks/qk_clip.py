"""QK-Clip: what measuring the max logit costs against the forward, and a run where the logits grow without it.

1. Cost: a small transformers Llama (GQA, SDPA) in training mode, the forward timed with and without
   `QKClipper.recording()` (the exact per-head max logit of every layer, in chunks), interleaved, medians;
   also against forward + backward, and the clip itself.
2. The run: a tiny Llama under `MuonMixin` with a high Muon lr on a copy task (8 random tokens repeated), once
   measuring only (``QKClip(tau=None)``) and once clipping at ``tau``; the per-update max logit and the loss.

    python benchmarks/qk_clip.py            # prints the results
    python benchmarks/qk_clip.py --write    # and writes benchmarks/results/qk_clip.md, qk_clip.png, RESULTS.md
"""

from __future__ import annotations

import argparse
import csv
import functools
import logging
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_muon import Muon, MuonMixin, QKClip
from lightning_muon.attention import QKClipper

import _common
import _report


def llama(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048, bos_token_id=0,
        eos_token_id=1,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def cost(args: argparse.Namespace) -> str:
    torch.manual_seed(0)
    model = llama(args.hidden, args.layers, args.heads, args.kv_heads, 512).train()
    ids = torch.randint(512, (args.batch, args.seq))
    clipper = QKClipper(model, tau=100.0)

    def forward():
        return model(ids).logits

    def measured_forward():
        with clipper.recording():
            return model(ids).logits

    def step(measured: bool):
        logits = measured_forward() if measured else forward()
        logits.float().mean().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):  # warm up
        step(True)
        step(False)
    plain, measured, plain_step, measured_step = [], [], [], []
    for rep in range(args.reps):  # interleaved, in alternating order, so slow spells and order effects hit both
        pairs = [(plain, forward), (measured, measured_forward)]
        steps = [(plain_step, lambda: step(False)), (measured_step, lambda: step(True))]
        for times, fn in (pairs if rep % 2 else pairs[::-1]) + (steps if rep % 2 else steps[::-1]):
            times.append(_median_ms(fn, 1))
    clip_ms = _median_ms(clipper.clip, args.reps)
    clipper.remove()
    f, fm = statistics.median(plain), statistics.median(measured)
    s, sm = statistics.median(plain_step), statistics.median(measured_step)
    return (
        f"cost: Llama {args.layers} layers, width {args.hidden}, {args.heads} query / {args.kv_heads} key heads, "
        f"batch {args.batch} x {args.seq} tokens, SDPA, float32: forward {f:.1f} ms, with the max-logit measurement "
        f"{fm:.1f} ms ({fm / f:.2f}x the forward, +{fm - f:.1f} ms); forward + backward {s:.1f} ms, measured "
        f"{sm:.1f} ms ({sm / s:.2f}x); the clip itself {clip_ms:.2f} ms (medians of {args.reps})"
    )


class CopyLM(L.LightningModule):
    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.model = llama(64, 2, 4, 2, vocab)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.model(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        self.log("train_loss", loss)
        return loss


class MuonCopyLM(MuonMixin, CopyLM):
    pass


def run(lr: float, tau: float | None, steps: int) -> tuple[list[float], list[float]]:
    """Per update: the max logit (measured before that update's clip) and the training loss."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    patterns = torch.randint(64, (16 * steps, 8), generator=g)
    data = DataLoader(TensorDataset(patterns.repeat(1, 5)[:, :33]), batch_size=16)
    model = MuonCopyLM(muon=functools.partial(Muon, lr=lr))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, logger=CSVLogger(tmp, name="", version=""),
            log_every_n_steps=1, callbacks=[QKClip(tau=tau)], enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
        )
        trainer.fit(model, train_dataloaders=data)
        with open(Path(tmp) / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    logits = [float(r["attention/max_logit"]) for r in rows if r.get("attention/max_logit")]
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    return logits, losses


def plot(path: Path, curves: dict[str, tuple[list[float], list[float]]], tau: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for label, (logits, losses) in curves.items():
        top.plot(logits, label=label)
        bottom.plot(losses, label=label)
    top.axhline(tau, color="grey", linestyle="--", linewidth=1, label=f"tau = {tau:g}")
    top.set_ylabel("max attention logit")
    bottom.set_ylabel("training loss")
    bottom.set_xlabel("update")
    top.legend()
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=0.05, help="the run's Muon lr (high for this width on purpose)")
    parser.add_argument("--tau", type=float, default=30.0, help="the run's tau (K2's 100 is not reached here)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/qk_clip.md (else: print)")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(torch.get_num_threads())

    lines = [cost(args)]
    print(lines[0], flush=True)
    curves = {}
    for label, tau in (("no clip (measured only)", None), (f"QKClip(tau={args.tau:g})", args.tau)):
        logits, losses = run(args.lr, tau, args.steps)
        curves[label] = (logits, losses)
        tail = losses[-20:]
        first = next((i for i, v in enumerate(logits) if v > args.tau), len(logits))
        after = logits[first:] or [float("nan")]
        line = (
            f"run, {label}: max logit {logits[0]:.2f} at the first update, {max(logits):.1f} at most "
            f"(update {logits.index(max(logits))}), {logits[-1]:.1f} at the last; first over tau at update "
            f"{first}, from there median {statistics.median(after):.1f}; loss {losses[0]:.3f} -> "
            f"{statistics.mean(tail):.3f} (mean of the last 20)"
        )
        lines.append(line)
        print(line, flush=True)
    if args.write:
        png = _report.RESULTS / "qk_clip.png"
        plot(png, curves, args.tau)
        details = (
            f"{_common.machine()}; the run: transformers Llama width 64, 2 layers, 4 query / 2 key heads, "
            f"MuonMixin with Muon lr {args.lr:g}, batch 16 x 32 tokens of a copy task, {args.steps} updates; "
            "plot: results/qk_clip.png"
        )
        text = "\n".join(f"- {line}" for line in lines) + "\n"
        path = _report.write("qk_clip", "QK-Clip", _report.command("qk_clip.py", argv), details, [], text)
        print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
