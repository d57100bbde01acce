# temporary GPU diagnostic: where the probe planes differ from the reference
import torch
from sparsespec.kernels.binarypc import probe_planes, probe_planes_ref
g = torch.Generator().manual_seed(7 * 1000 + 100)
d = lambda *s: (torch.randint(-8, 9, s, generator=g) / 8).cuda()
q = d(2, 21, 64); basis = d(2, 3, 100, 64)
a, la = probe_planes(q, basis, 3); b, lb = probe_planes_ref(q, basis, 3)
diff = (a != b).nonzero()
print("planes differ at", diff[:10].tolist(), "l1 equal", torch.equal(la, lb))
for r, gg, j, w in diff[:4].tolist():
    print(r, gg, j, w, hex(a[r, gg, j, w].item() & (2**64 - 1)), hex(b[r, gg, j, w].item() & (2**64 - 1)))
probe = q.view(2, 3, 7, 64).float() @ basis.transpose(-1, -2)
print("probe exact vs fp64:", (probe.double() - (q.view(2, 3, 7, 64).double() @ basis.double().transpose(-1, -2))).abs().max().item())
