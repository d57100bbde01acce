"""ncu target: BinaryPC keys at 16 x 128k, score + select a few times."""
import sys
import torch
sys.path.insert(0, "bench")
from select_paths import binarypc_keys
from sparsespec.kernels.select import select_topk
B, S = 16, 131072
keys, positions, key_bits = binarypc_keys(B, S)
k = int(S * 0.02) + 68
tokens = torch.full((B,), int(S * 0.02), dtype=torch.int32, device="cuda")
for _ in range(3):
    select_topk(keys, positions, tokens, positions + 1, k, key_bits, sinks=4, window=64)
torch.cuda.synchronize()
