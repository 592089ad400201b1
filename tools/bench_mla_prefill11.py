"""Host time of the MLA prefill's SDPA call on new shapes (session 11): SDPA's own backend choice vs
attention_math.MLA_PREFILL_SDPA_BACKENDS (every backend but cuDNN), k3-mini-6b's MLA shape (16 heads, latent 512,
rope 64, nope 128, v 128), bf16, one request per call, prompt lengths never seen before in each arm (as serving
sees them). Per arm: mean, max and first wall ms of a call (synchronized).
    python tools/bench_mla_prefill11.py
"""
import time

import torch
from torch.nn.attention import SDPBackend

from k3compile.model_def.ops import attention_math as am

H, NOPE, ROPE, V, R = 16, 128, 64, 128, 512
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
w = (torch.randn(H * (NOPE + V), R, device=dev, generator=g) * 0.05).bfloat16()
ALL = list(SDPBackend.__members__.values())
OURS = list(am.MLA_PREFILL_SDPA_BACKENDS)
arms = {"sdpa's choice": [b for b in ALL if b.name not in ("ERROR", "OVERRIDEABLE")],
        "no cuDNN (ours)": OURS,
        "cuDNN only": [SDPBackend.CUDNN_ATTENTION]}
for a, (name, backends) in enumerate(arms.items()):
    times = []
    for i in range(16):
        T = 7 + 5 * i + 97 * a          # new lengths in every arm: a shape seen before would hit a cache
        q = torch.randn(1, T, H, NOPE + ROPE, device=dev, generator=g).bfloat16()
        rows = torch.randn(1, T, R + ROPE, device=dev, generator=g).bfloat16()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            am.MLA_PREFILL_SDPA_BACKENDS = backends   # the function reads it at call time
            am.mla_expanded_sdpa_batch(q, rows, w, R, NOPE, 0.1, torch.zeros(1, dtype=torch.long, device=dev))
            torch.cuda.synchronize()
        except RuntimeError as e:
            print(f"{name}: {str(e).splitlines()[0][:160]}")
            break
        times.append((time.perf_counter() - t0) * 1e3)
    if times:
        print(f"{name:18s} calls {len(times):2d}  mean {sum(times) / len(times):8.3f} ms  max {max(times):8.3f} ms  "
              f"first {times[0]:8.3f} ms")
