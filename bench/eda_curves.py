"""Held-out τ against GPU seconds for the runs of one EDA table (`scripts/gpu_eda.sh`'s folder layout).

    python bench/eda_curves.py docs/results/eda-shakespeare-1.5b/fifteenth [--answers loss] [--out curves.png]

Reads FOLDER/<run>/summary.json of every run (`train eda` runs and the `train dflash` retrain) and prints, per run,
its trainable parameters, GPU seconds (answers + scoring + optimisation, evaluations included), and held-out τ
on the decoding loop's schedule and by uniform anchors; plots the uniform-anchor τ of each evaluation during
optimisation against the GPU seconds spent by then (answers, scoring and optimisation, evaluations left out:
the only estimate taken during training), with each run's final loop-schedule τ marked at its end.
`--answers RUN`: the run whose regenerated answers the other regenerated EDA runs reused (gpu_eda.sh: `loss`);
their answer seconds are that run's, not the few seconds they spent reloading them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_runs(folder: Path, answers: str | None) -> dict[str, dict]:
    """{run name: {trainable, answer_s, score_s, train_s, tau, tau_decoding, curve: [(GPU s, τ)]}}."""
    summaries = {p.parent.name: json.loads(p.read_text()) for p in sorted(folder.glob("*/summary.json"))}
    summaries = {name: s for name, s in summaries.items() if "heldout_tau" in s}  # (the fine-tune's has none)
    if not summaries:
        raise SystemExit(f"error: no run summaries (*/summary.json with a held-out tau) under {folder}")
    if answers is not None and answers not in summaries:
        raise SystemExit(f"error: --answers {answers}: no such run under {folder} ({', '.join(summaries)})")
    runs = {}
    for name, s in summaries.items():
        eda = s.get("eda")
        reused = answers is not None and name != answers and eda is not None and eda.get("data") == "regenerated"
        answer_s = summaries[answers]["data_seconds"] if reused else s["data_seconds"]
        score_s = s.get("score_seconds", 0.0)
        before = answer_s + score_s
        trainable = s.get("trainable_parameters")
        if trainable is None and (folder / name / "drafter.json").is_file():  # a drafter trained whole
            trainable = drafter_parameters(folder / name / "drafter.json")
        runs[name] = {"trainable": trainable, "answer_s": answer_s, "score_s": score_s,
                      "train_s": s["train_seconds"], "tau": s["heldout_tau"],
                      "tau_decoding": s.get("heldout_tau_decoding"), "base_tau": s.get("base_heldout_tau"),
                      "base_tau_decoding": s.get("base_heldout_tau_decoding"),
                      "curve": [(before + h["seconds"], h["heldout_tau"]) for h in s.get("history", [])]}
    return runs


def drafter_parameters(path: Path) -> int:
    """The parameter count of the DFlash drafter a drafter.json describes (built on the meta device)."""
    import torch

    from sparsespec.spec.dflash import DFlash, DFlashConfig

    with torch.device("meta"):
        model = DFlash(DFlashConfig.from_json(json.loads(path.read_text())["config"]))
    return sum(p.numel() for p in model.parameters())


def table(runs: dict[str, dict]) -> str:
    lines = ["| run | trainable parameters | GPU s: answers + scoring + optimisation | held-out τ, loop's schedule "
             "| held-out τ, uniform anchors |", "|---|---:|---:|---:|---:|"]
    for name, r in runs.items():
        total = r["answer_s"] + r["score_s"] + r["train_s"]
        trainable = f"{r['trainable']:,}" if r["trainable"] is not None else "?"
        decoding = f"{r['tau_decoding']:.2f}" if r["tau_decoding"] is not None else "-"
        lines.append(f"| {name} | {trainable} | {r['answer_s']:.1f} + {r['score_s']:.1f} + {r['train_s']:.1f} = "
                     f"{total:.0f} | {decoding} | {r['tau']:.2f} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, r in runs.items():
        if not r["curve"]:
            continue
        xs, ys = zip(*r["curve"])
        line, = ax.plot(xs, ys, marker=".", label=f"{name} (uniform anchors)")
        if r["tau_decoding"] is not None:
            end = xs[-1]  # (the table's total also counts the evaluations)
            ax.plot([end], [r["tau_decoding"]], marker="*", markersize=11, color=line.get_color(), linestyle="none")
    base = next((r for r in runs.values() if r["base_tau"] is not None), None)
    if base is not None:
        ax.axhline(base["base_tau"], color="grey", linestyle=":", label="base drafter (uniform anchors)")
    if any(r["tau_decoding"] is not None for r in runs.values()):
        ax.plot([], [], marker="*", markersize=11, color="black", linestyle="none", label="final, loop's schedule")
    ax.set_xlabel("GPU seconds (answers + scoring + optimisation)")
    ax.set_ylabel("held-out τ")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="an EDA table's folder: one sub-folder per run with its summary.json")
    ap.add_argument("--answers", help="the run whose regenerated answers the other regenerated EDA runs reused")
    ap.add_argument("--out", type=Path, help="the plot (PNG; default FOLDER/tau_curves.png)")
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        raise SystemExit(f"error: {args.folder} is not a folder")
    runs = load_runs(args.folder, args.answers)
    print(table(runs))
    out = args.out or args.folder / "tau_curves.png"
    plot(runs, out, f"EDA runs and the retrain: held-out τ against GPU time ({args.folder.name})")
    print(f"plot: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
