"""GPU check of EDA's shift scores: tiny random targets, the same scores on CUDA (fp32) as on the CPU."""
import dataclasses
import torch
from sparsespec.spec.eda import shift_scores
from sparsespec.spec.train import regenerate
from tests.test_spec import tiny_engine

base, tuned = tiny_engine(5, vocab=48, scale=4.0), tiny_engine(6, vocab=48, scale=4.0)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 48, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (21,), generator=g)]
data = regenerate(tuned, prompts, (0, 1), 30, 8)
cpu = shift_scores(tuned.model, base.model, data, 5)
gpu_data = dataclasses.replace(data, **{f.name: getattr(data, f.name).cuda() for f in dataclasses.fields(data)})
gpu = shift_scores(tuned.model.cuda(), base.model.cuda(), gpu_data, 5).cpu()
print("max |cpu - cuda|:", float((cpu - gpu).abs().max()), "scores", [round(float(x), 3) for x in cpu[:6]])
assert torch.allclose(cpu, gpu, rtol=1e-4, atol=1e-4)
print("shift scores on cuda: OK")
