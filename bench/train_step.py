"""Where a DFlash training step's time goes (GPU): `train dflash`'s own step (`spec.train.train_step`) on a target of
real shape with random weights and a synthetic data set of realistic lengths, for several (sequences x anchors)
settings at an equal or chosen number of blocks: ms a step, blocks and block tokens a second, the step's two
halves (forward with the loss; backward, clip and optimiser) and the largest kernels under torch.profiler.

    python bench/train_step.py [--shape qwen2.5-coder-1.5b] [--layers 3] [--intermediate-size 2048]
                               [--settings 8x64,16x32,32x16] [--block 16] [--sequences 512] [--steps 20]
                               [--warmup 30]

What is timed does not depend on the values (random weights, tokens and features), except the step that a
non-finite gradient would skip (none with these inputs: every step is applied).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from sparsespec.models.shapes import random_model, shape
from sparsespec.sparse_bench import kernel_times
from sparsespec.spec.dflash import DFlash, DFlashConfig, default_taps
from sparsespec.spec.train import Dataset, TrainConfig, autocast_for, step_loss, step_update, train_step


def synthetic_data(cfg, taps: int, n: int, prompt: tuple[int, int], response: tuple[int, int],
                   device: torch.device, seed: int = 0) -> Dataset:
    """n packed sequences: prompt and response lengths uniform in the given ranges, random tokens and features."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    p = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g)
    r = torch.randint(response[0], response[1] + 1, (n,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), (p + r).cumsum(0)]).to(device)
    S = int(offsets[-1])
    tokens = torch.randint(0, cfg.vocab_size, (S,), generator=g).to(device)
    features = torch.randn(S, taps * cfg.hidden_size, dtype=torch.bfloat16, device=device)
    return Dataset(tokens, offsets, p.to(device), features)


def phases_ms(drafter, target, data, cfg, opt, g, autocast, steps: int) -> dict[str, float]:
    """Median ms of the step's two halves (`step_loss`, `step_update`) over `steps` steps, CUDA events between."""
    marks = {k: [] for k in ("forward + loss", "backward + clip + optimiser")}
    for _ in range(steps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        loss = step_loss(drafter, target, data, cfg, g, autocast)
        ev[1].record()
        step_update(drafter, loss, cfg, opt)
        ev[2].record()
        torch.cuda.synchronize()
        for (name, times), a, b in zip(marks.items(), ev, ev[1:]):
            times.append(a.elapsed_time(b))
    return {name: statistics.median(times) for name, times in marks.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b", help="the target's shape (random weights)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--intermediate-size", type=int, default=2048)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--settings", default="8x64,16x32,32x16", help="SEQUENCESxANCHORS a step, comma-separated")
    ap.add_argument("--sequences", type=int, default=512, help="sequences in the synthetic data set")
    ap.add_argument("--prompt", default="100,500", help="prompt length range (tokens)")
    ap.add_argument("--response", default="50,256", help="response length range (tokens)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps a setting (after the warm-up steps)")
    ap.add_argument("--warmup", type=int, default=30, help="untimed steps first: every padded length planned")
    ap.add_argument("--top", type=int, default=15, help="kernels listed for the first setting")
    args = ap.parse_args()
    device = torch.device("cuda")
    tcfg = shape(args.shape)
    target = random_model(tcfg, device)
    taps = default_taps(tcfg.num_layers, 3)
    data = synthetic_data(tcfg, len(taps), args.sequences, tuple(map(int, args.prompt.split(","))),
                          tuple(map(int, args.response.split(","))), device)
    dcfg = DFlashConfig(tcfg, args.layers, args.block, taps, args.intermediate_size)
    params = sum(p.numel() for p in DFlash(dcfg).parameters())
    print(f"{args.shape} target (random weights), drafter {args.layers} layers, MLP {dcfg.intermediate_size}, "
          f"block {args.block}: {params / 1e6:.1f}M parameters; {len(data)} sequences, "
          f"{int(data.lengths.float().mean())} tokens on average, {torch.cuda.get_device_name()}")
    autocast = autocast_for(device)
    print(f"\n| sequences x anchors | blocks | ms a step | blocks/s | block tokens/s | forward + loss | "
          f"backward + clip + optimiser |\n|---|---:|---:|---:|---:|---:|---:|")
    for i, setting in enumerate(args.settings.split(",")):
        batch, anchors = map(int, setting.split("x"))
        cfg = TrainConfig(batch=batch, anchors=anchors, block_size=args.block)
        torch.manual_seed(0)
        drafter = DFlash(dcfg).to(device)
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        g = torch.Generator(device=device).manual_seed(0)
        for _ in range(args.warmup):
            train_step(drafter, target, data, cfg, opt, g, autocast)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            loss, applied = train_step(drafter, target, data, cfg, opt, g, autocast)
            assert applied, "a non-finite step: timing would not be of a whole step"
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.steps
        ph = phases_ms(drafter, target, data, cfg, opt, g, autocast, args.steps)
        blocks = batch * anchors
        print(f"| {setting} | {blocks} | {ms:.1f} | {blocks / ms * 1e3:,.0f} | {blocks * args.block / ms * 1e3:,.0f} | "
              + " | ".join(f"{v:.1f}" for v in ph.values()) + " |")
        if i == 0:
            rows = kernel_times(lambda: train_step(drafter, target, data, cfg, opt, g, autocast), 5, args.top)
            table = [f"  {us / 1e3:8.2f} ms {n:5d}x  {name[:100]}" for name, us, n in rows]
    print(f"\nlargest kernels of {args.settings.split(',')[0]} (ms a step, launches a step):")
    print("\n".join(table))


if __name__ == "__main__":
    main()
