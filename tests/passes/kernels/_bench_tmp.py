import torch, triton.testing as tt
from k3compile.passes.kernels.routing import route_triton
def chain(z,b):
    s=z.float().sigmoid(); i=(s+b).topk(16,-1,sorted=False)[1]; w=s.gather(1,i)
    return w/(w.sum(-1,keepdim=True)+1e-20)*1.0, i
b=torch.randn(896,device="cuda")*0.01
for T in (1,64,256,4096):
    z=torch.randn(T,896,device="cuda").bfloat16()
    f=lambda: route_triton(z,b,16,True,1.0); g=lambda: chain(z,b)
    print(f"T={T} fused {tt.do_bench_cudagraph(f)*1e3:.1f}us chain {tt.do_bench_cudagraph(g)*1e3:.1f}us (cuda-graph replay)")
