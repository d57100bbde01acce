import torch
from torch.profiler import ProfilerActivity, profile
from sparsespec.attention import make_policy
from sparsespec.models.shapes import LLAMA31_8B
from sparsespec.sparse_bench import random_cache
import time
cache = random_cache(LLAMA31_8B, 1, 131072, layers=1)
for opts in (["kmeans_iters=3"], ["kmeans_iters=2"]):
    policy = make_policy("doublep", [*opts, "dense_layers=0"])
    policy.build(0, cache, [131072]); torch.cuda.synchronize()
    t = time.perf_counter(); policy.build(0, cache, [131072]); torch.cuda.synchronize()
    print(opts, "build", time.perf_counter() - t)
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    policy.build(0, cache, [131072]); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
