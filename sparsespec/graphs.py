"""One decode step captured as a CUDA graph: B tokens at per-row positions, attending the whole static cache.

Static shapes make this possible: the cache is preallocated and the mask hides slots past each row's position,
so a replay only needs the new tokens and positions copied into the graph's input buffers.
"""

from __future__ import annotations

import torch

from .cache import KVCache
from .models.transformer import Transformer

class CudaGraphDecodeStep:
    def __init__(self, model: Transformer, cache: KVCache, compile: bool = False, warmup: int = 3):
        """`compile`: run the step through torch.compile first, which fuses the small element-wise kernels (norms,
        rotary, SwiGLU, residuals) that otherwise dominate a batch-1 step; costs a compilation per shape."""
        device = cache.device
        self.step = torch.compile(self._step, fullgraph=True, dynamic=False) if compile else self._step
        self.tokens = torch.zeros(cache.batch, 1, dtype=torch.long, device=device)  # [B, 1]
        # Warm-up and capture write at the last slot of each row: never a committed token (capacity > length).
        self.positions = torch.full((cache.batch, 1), cache.capacity - 1, dtype=torch.long, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(warmup):
                self.step(model, cache)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.logits = self.step(model, cache)  # [B, V] fp32, overwritten by each replay

    def _step(self, model: Transformer, cache: KVCache) -> torch.Tensor:
        return model.logits(model(self.tokens, self.positions, cache)[:, -1])

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [B] -> next-token logits [B, V] (a view reused by the next call)."""
        self.tokens.copy_(tokens[:, None])
        self.positions.copy_(positions[:, None])
        self.graph.replay()
        return self.logits
