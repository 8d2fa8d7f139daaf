import sys, functools, subprocess, threading, time
from pathlib import Path
import torch, triton
sys.path.insert(0, "tools")
import bench_kernels as B
from rlcore.kernels import linear_rl_loss
from rlcore import keys

def ms(fn, rep=1500):
    return float(triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median"))

samples = []
stop = False
def poll():
    while not stop:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.strip()
        samples.append(out)
        time.sleep(0.2)
def clocks(label, fn):
    global stop, samples
    samples = []
    stop = False
    t = threading.Thread(target=poll); t.start()
    r = fn()
    stop = True; t.join()
    vals = [tuple(float(x) for x in s.split(",")) for s in samples if s]
    mid = vals[len(vals)//4: 3*len(vals)//4] or vals
    print(f"{label}: {r:.2f} ms | SM clock {sum(v[0] for v in mid)/len(mid):.0f} MHz, power {sum(v[1] for v in mid)/len(mid):.0f} W ({len(mid)} samples)")
    return r

n, h, v = B.LINEAR_SHAPE
a = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
b = torch.randn(12288, h, device="cuda", dtype=torch.bfloat16)
one = clocks("floor shape, 1 matmul per call", lambda: ms(lambda: a @ b.T, rep=3000))
def many():
    for _ in range(40):
        a @ b.T
forty = clocks("floor shape, 40 matmuls per call (per matmul)", lambda: ms(many, rep=3000) / 40)
flops = 2 * n * h * 12288
print(f"  rate {flops / one / 1e9:.0f} vs {flops / forty / 1e9:.0f} TFLOP/s")
hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5 * 4
logits = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
gh, gw = torch.empty_like(hidden), torch.empty_like(weight)
def three():
    torch.mm(hidden, weight.T, out=logits)
    torch.mm(logits, weight, out=gh)
    torch.mm(logits.T, hidden, out=gw)
t3 = clocks("3 whole-batch matmuls", lambda: ms(three))
floor = 3 * 2 * n * h * v / (flops / one) 
print(f"  extrapolated floor {floor:.1f} ms; measured 3 matmuls {t3:.1f} ms")
del logits
torch.cuda.empty_cache()
tc = clocks("3 matmuls in 4096-row chunks", lambda: ms(functools.partial(B.chunked_matmuls, hidden, weight, 4096)))
targets = torch.randint(0, v, (n,), device="cuda")
td = B.loss_batch(n)
lengths = td[keys.MASK].sum(-1).tolist()
def step():
    hh = hidden.detach().requires_grad_(); ww = weight.detach().requires_grad_()
    return torch.autograd.grad(linear_rl_loss(hh, ww, targets, td, B.FUSED_LOSS_CONFIG, seq_lengths=lengths)[0], [hh, ww])
tf = clocks("fused loss", lambda: ms(step))
sleep_cycles = int(3e-3 * torch.cuda.clock_rate() * 1e6) if hasattr(torch.cuda, "clock_rate") else 5_000_000
ts = ms(lambda: torch.cuda._sleep(sleep_cycles))
tsf = ms(lambda: (torch.cuda._sleep(sleep_cycles), step()))
print(f"fused loss queued behind {ts:.2f} ms of GPU sleep: {tsf - ts:.2f} ms")
print(f"fused {tf:.1f} ms = {tf / floor:.3f}x extrapolated floor, {tf / t3:.3f}x measured 3 matmuls, {tf / tc:.3f}x chunked matmuls")
