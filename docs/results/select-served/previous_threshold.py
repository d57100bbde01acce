"""Whether a threshold carried over from the step before would serve a row's candidate select: a torch emulation
over a real model's BinaryPC keys (qwen2.5-coder-0.5b on CPU, the held-out long-code prompt of CHARS characters,
every sparse layer of STEPS greedy decode steps). For each (layer, KV head) and each step after the first, the
threshold is taken from the previous step's ranked keys — the key at rank ceil(F x want), lowered by D key units —
and the row counts as served when its keys at or above it hold its selection and fit the candidate buffer
(want <= total <= C, C = candidate_width for room 2 and 4): the condition under which the candidate path selects
exactly. The sampled threshold of the current step (stride 16, margin 16, two levels) beside it for reference.
(Forty-sixth session: would a scorer that counts and stages candidates against the previous step's threshold, with
no sample passes, serve its rows?)

    python docs/results/select-served/previous_threshold.py [CHARS [STEPS]]
"""
import sys

import numpy as np

from real_keys import select_calls
from sparsespec.kernels.select import candidate_width, sampled_slots

chars = int(sys.argv[1]) if len(sys.argv) > 1 else 24000
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
n_tokens, calls = select_calls(chars, steps)
print(f"long-code prompt of {n_tokens} tokens, {steps} steps, {len(calls)} selects", flush=True)


def ranked(call):
    """-> per row: (ranked keys [S] int64, want, K, S)"""
    layer, keys, positions, tokens, ff, K, bits, extra, extra_n = call
    R, S = keys.shape
    hkv = R // positions.shape[0]
    mask = (1 << bits) - 1
    out = []
    for r in range(R):
        b = r // hkv
        pos = int(positions[b])
        s = np.arange(S)
        key = keys[r].numpy().astype(np.int64) & mask
        forced = (s < 4) | (s > pos - 64) | (s >= int(ff[b]))
        if extra is not None and extra.shape[1] > 0:
            forced[extra[r, :int(extra_n[b])].numpy()] = True
        key = np.where(s <= pos, np.where(forced, mask, key), 0)
        want = min(max(int(tokens[b]), int((key == mask).sum())), int((key > 0).sum()), K)
        out.append((key, want, K, S, mask))
    return out


def crossing(hist, k):
    suffix = hist.sum() - np.cumsum(hist) + hist
    t = int((suffix >= k).sum()) - 1
    return t, k - int(hist[t + 1:].sum())


def sampled_threshold(key, want, bits_low, S, pos, stride=16, margin=16):
    n = pos + 1
    n_s = (n + stride - 1) // stride
    target = max((want * 5 * n_s + 4 * n - 1) // (4 * n) + margin, 1)
    ss = sampled_slots(S, stride).numpy()[:n_s]
    sk = np.where(ss <= pos, key[np.minimum(ss, S - 1)], 0)
    live = sk[sk > 0]
    top = np.bincount(live >> bits_low, minlength=256)[:256]
    if target > top.sum():
        return 1
    d, k2 = crossing(top, target)
    sub = np.bincount(live[(live >> bits_low) == d] & ((1 << bits_low) - 1), minlength=1 << bits_low)
    d2, _ = crossing(np.pad(sub, (0, 256 - len(sub))), k2)
    return max((d << bits_low) + d2, 1)


by_step = {}
for c in calls:
    by_step.setdefault(c[0], []).append(c)  # layer -> its selects, step by step
settings = [(f, d) for f in (1.0, 1.25, 1.5) for d in (0, 16, 64)]
stats = {s: [0, 0, 0, 0, 0] for s in settings}  # rows, served room 2, short, over room 2, served room 4
sampled = [0, 0, 0]
for layer, seq in by_step.items():
    rows = [ranked(c) for c in seq]
    bits = seq[0][6]
    for t in range(1, len(seq)):
        pos = int(seq[t][2][0])
        for r, ((prev, pwant, _, _, _), (key, want, K, S, mask)) in enumerate(zip(rows[t - 1], rows[t])):
            c2, c4 = candidate_width(K, S, 2), candidate_width(K, S, 4)
            order = np.sort(prev[prev > 0])[::-1]
            for f, d in settings:
                rank = min(int(np.ceil(f * pwant)), len(order)) - 1
                lo = max(int(order[rank]) - d, 1)
                total = int((key >= lo).sum())
                st = stats[(f, d)]
                st[0] += 1
                st[1] += int(want <= total <= c2)
                st[2] += int(total < want)
                st[3] += int(total > c2)
                st[4] += int(want <= total <= c4)
            lo = sampled_threshold(key, want, bits - 8, S, pos)
            total = int((key >= lo).sum())
            sampled[0] += 1
            sampled[1] += int(want <= total <= c2)
            sampled[2] += int(want <= total <= c4)
print(f"sampled threshold of the step itself (stride 16, margin 16): served {sampled[1]}/{sampled[0]} (room 2), "
      f"{sampled[2]} (room 4)")
for (f, d), st in stats.items():
    print(f"previous step's key at rank {f} x want, less {d}: served {st[1]}/{st[0]} (room 2; short {st[2]}, over "
          f"{st[3]}), {st[4]} with room 4", flush=True)
