"""How many rows of a real model's BinaryPC keys the candidate select serves: the others fall back to the radix
passes (the same selection, more time), so a workload that makes rows fall back is slower than the random keys of
`bench/select_paths.py` say. BinaryPC's keys of every sparse layer's fixed-width decode steps after a long-code
prompt, computed on the CPU with real weights, then selected by the candidate path in Triton's interpreter at each
sample stride / margin asked for; every selection is checked against the reference.

    python bench/select_served.py --model qwen2.5-coder-0.5b --kind long-code --long-chars 24000 --steps 3 \
        --settings 16/16,16/0

Prints, per setting, the rows served of all rows and whether every selection equals the reference's.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the select's kernels on CPU tensors (set before Triton loads)

import argparse  # noqa: E402

import torch  # noqa: E402

from sparsespec.attention import make_policy, parse_spec  # noqa: E402
from sparsespec.generate import Engine  # noqa: E402
from sparsespec.kernels.select import CANDIDATE_ROOM, same_selection, select_topk, select_topk_ref  # noqa: E402
from sparsespec.runner import Runner  # noqa: E402
from sparsespec.spec.prompts import make_prompts  # noqa: E402


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--attention", default="binarypc:budget=0.02,sinks=4,window=64",
                    help="a policy whose keys have at most 16 bits (BinaryPC; the candidate path takes no others)")
    ap.add_argument("--kind", default="long-code", choices=("long-code", "long-text", "long-essay"),
                    help="the prompt: code of the standard library, or prose of the packaged corpora")
    ap.add_argument("--seed", type=int, default=0, help="which prompt of the kind")
    ap.add_argument("--long-chars", type=int, default=24000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--settings", default="16/16,16/0",
                    help="sample stride / margin [/ room for candidates, in selection widths], comma-separated")
    args = ap.parse_args()
    engine = Engine.from_name(args.model, device="cpu", dtype="float32")
    ids = engine.encode(make_prompts(1, "heldout", (args.kind,), args.seed, args.long_chars)[0].text, chat=True)
    name, opts = parse_spec(args.attention)
    policy = make_policy(name, opts)
    runner = Runner(engine.model, 1, len(ids) + args.steps + 1, policy, fixed=True)
    calls = []  # each layer's select of each step, as the policy asks for it
    keys_of = policy.fixed_keys

    def kept_keys(layer, q, cache):  # the policy's keys, kept with the plan's arguments of that select
        sk = keys_of(layer, q, cache)
        plan = policy.fixed
        forced_from = plan.positions + 1 if sk.forced_from is None else sk.forced_from
        calls.append(((sk.keys.clone(), plan.positions.clone(), plan.tokens.clone(), forced_from.clone(),
                       plan.buffers(layer)[0].shape[1], sk.key_bits),
                      dict(sinks=policy.options.sinks, window=policy.options.window,  # (a plan's lists change in
                           extra=None if sk.extra is None else sk.extra.clone(),  # place from step to step)
                           extra_n=None if sk.extra_n is None else sk.extra_n.clone())))
        return sk

    policy.fixed_keys = kept_keys
    token = engine.model.logits(runner.prefill([ids])).argmax(-1)
    for _ in range(args.steps):
        token = runner.decode(token).argmax(-1)  # [1]: greedy
    if any(a[5] > 16 for a, _ in calls):
        raise SystemExit(f"{args.attention}: keys of more than 16 bits, which the candidate path does not take")
    rows = sum(a[0].shape[0] for a, _ in calls)
    print(f"{args.model}, {args.attention}: {args.kind} prompt (seed {args.seed}) of {len(ids)} tokens, "
          f"{args.steps} steps, {len(calls)} selects "
          f"({rows} rows of (layer, KV head))")
    refs = [select_topk_ref(*a, **kw) for a, kw in calls]  # what every setting must select
    for setting in args.settings.split(","):
        stride, margin, room = (list(map(int, setting.split("/"))) + [CANDIDATE_ROOM])[:3]
        served_rows, same = 0, True
        for (a, kw), ref in zip(calls, refs):
            served = torch.empty(a[0].shape[0], dtype=torch.int32)
            got = select_topk(a[0].clone(), *a[1:], sampled=True, stride=stride, margin=margin, room=room,
                              served=served, **kw)
            same &= same_selection(got, ref)
            served_rows += int(served.sum())
        print(f"  stride {stride}, margin {margin}, room {room}: {served_rows} of {rows} rows served by candidates; "
              f"same selection as the reference: {same}")


if __name__ == "__main__":
    main()
