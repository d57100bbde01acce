"""How many rows of a real model's BinaryPC keys a one-level sample threshold (the floor of the top digit's crossing
bin) would serve, against the candidate select's two levels: a torch emulation of the sample passes' arithmetic
(`_jittered`, `_sample_target`, `_crossing` in sparsespec/kernels/select.py) over the keys of every sparse layer's
decode steps, qwen2.5-coder-0.5b on CPU, the held-out long-code prompt of CHARS characters (forty-fifth session).

    python docs/results/select-served/one_level.py [CHARS [STEPS]]
"""
import sys

import numpy as np
import triton

from real_keys import select_calls
from sparsespec.kernels.select import candidate_width

chars = int(sys.argv[1]) if len(sys.argv) > 1 else 24000
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
n_tokens, calls = select_calls(chars, steps)
print(f"long-code prompt of {n_tokens} tokens, {steps} steps, {sum(c[1].shape[0] for c in calls)} rows", flush=True)

def crossing(hist, k):
    suffix = hist.sum() - np.cumsum(hist) + hist
    t = int((suffix >= k).sum()) - 1
    above = int(hist[t + 1:].sum())
    return t, k - above

res = {}
for STRIDE, MARGIN in ((16, 16), (32, 16), (32, 32), (64, 32)):
    stats = {"one": [0, 0, [], 0, 0, 0], "two": [0, 0, [], 0, 0, 0]}  # rows, served, ratios, short, over, served C4
    for _, keys, positions, tokens, ff, K, bits, extra, extra_n in calls:
        R, S = keys.shape
        hkv = R // positions.shape[0]
        low = bits - 8
        mask = (1 << bits) - 1
        for r in range(R):
            b = r // hkv
            pos = int(positions[b]); n = pos + 1
            s = np.arange(S)
            key = keys[r].numpy().astype(np.int64) & mask
            forced = (s < 4) | (s > pos - 64) | (s >= int(ff[b]))
            if extra is not None and extra.shape[1] > 0:
                forced[extra[r, :int(extra_n[b])].numpy()] = True
            key = np.where(forced, mask, key)
            key = np.where(s <= pos, key, 0)
            n_s = (n + STRIDE - 1) // STRIDE
            want_tok = min(int(tokens[b]), K)
            target = max((want_tok * 5 * n_s + 4 * n - 1) // (4 * n) + MARGIN, 1)
            j = np.arange(n_s, dtype=np.int64)
            jit = ((j.astype(np.int32) * np.int32(-1640531535)).astype(np.int32) >> 16) & (STRIDE - 1)
            ss = j * STRIDE + jit
            sk = np.where(ss <= pos, key[np.minimum(ss, S - 1)], 0)
            live_s = sk[sk > 0]
            top = np.bincount(live_s >> low, minlength=256)[:256]
            n_forced = int((key == mask).sum()); live = int((key > 0).sum())
            want = min(max(int(tokens[b]), n_forced), live, K)
            C = candidate_width(K, S)
            if target > top.sum():
                lo1 = lo2 = 1
            else:
                d, k2 = crossing(top, target)
                lo1 = max(d << low, 1)
                sub = np.bincount(live_s[(live_s >> low) == d] & ((1 << low) - 1), minlength=1 << low)
                d2, _ = crossing(np.pad(sub, (0, 256 - len(sub))), k2)
                lo2 = max((d << low) + d2, 1)
            for nm, lo in (("one", lo1), ("two", lo2)):
                total = int((key >= lo).sum())
                st = stats[nm]
                st[0] += 1
                st[1] += int(want <= total <= C)
                st[3] += int(total < want)
                st[4] += int(total > C)
                st[5] += int(want <= total <= min(triton.next_power_of_2(4 * K + 256), S))
                st[2].append(total / max(want, 1))
    for nm, st in stats.items():
        print(f"stride {STRIDE} margin {MARGIN} {nm}-level: served {st[1]}/{st[0]} (short {st[3]}, over C {st[4]}; "
              f"{st[5]} with 4k + 256 candidates), "
              f"candidates/want mean {np.mean(st[2]):.2f} max {np.max(st[2]):.2f}", flush=True)
