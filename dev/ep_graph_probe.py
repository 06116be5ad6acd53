"""Where a compiled smoe.EPMoE hangs under CUDA graph capture (issue 17,
python/tests/test_ep_gpu.py::test_ep_compile_cuda_graph, skipped since
session 15). One process, WORLD 1, on one GPU:
    python3 dev/ep_graph_probe.py MODE
MODE: eager-graph (passes in the test), compiled (no graph), compiled-graph
(the hang). Prints a line per step; after LIMIT seconds (default 60)
faulthandler dumps every thread's Python stack and exits."""
import faulthandler, os, sys, tempfile, time
import torch
import torch.distributed as dist

mode = sys.argv[1] if len(sys.argv) > 1 else "compiled-graph"
faulthandler.dump_traceback_later(int(os.environ.get("LIMIT", "60")), exit=True)
t0 = time.time()
def say(*a):
    print("[%6.2f s] %s:" % (time.time() - t0, mode), *a, flush=True)

T, D, N, E = 96, 128, 64, 8
tmp = tempfile.mkdtemp()
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="file://" + os.path.join(tmp, "init"), rank=0,
                        world_size=1)
import smoe
g = torch.Generator().manual_seed(7)
bf = torch.bfloat16
wr = (torch.randn(E, D, generator=g)).to(bf)
w1 = (torch.randn(E, 2 * N, D, generator=g) * 0.1).to(bf)
w2 = (torch.randn(E, D, N, generator=g) * 0.1).to(bf)
x = torch.randn(T, D, generator=g).to(bf).cuda()
do = torch.randn(T, D, generator=g).to(bf).cuda()
m = smoe.EPMoE(E, 2, D, N, ep_group=smoe.EPGroup(), max_tokens=T).cuda().to(bf)
with torch.no_grad():
    m.router.weight.copy_(wr); m.c_fc.weight.copy_(w1); m.c_proj.weight.copy_(w2)
params = [m.c_fc.weight, m.c_proj.weight, m.router.weight]

def step(f, xs):
    out = f(xs)[0]
    return [out] + list(torch.autograd.grad(out, [xs] + params, do))

want = [t.detach().clone() for t in step(m, x.clone().requires_grad_())]
say("eager step done")
f = torch.compile(m, fullgraph=True) if mode.startswith("compiled") else m
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for i in range(2):
        got = step(f, x.clone().requires_grad_())
        torch.cuda.synchronize()
        say("warm-up step %d done, equal to eager: %s" % (i, [torch.equal(a, b) for a, b in zip(got, want)]))
    if mode.endswith("graph"):
        gr = torch.cuda.CUDAGraph()
        xs = x.clone().requires_grad_()
        say("capture begins")
        with torch.cuda.graph(gr, stream=s, capture_error_mode="thread_local"):
            say("in capture: forward")
            out = f(xs)[0]
            say("in capture: backward")
            got = [out] + list(torch.autograd.grad(out, [xs] + params, do))
            say("in capture: done")
        say("capture ended")
torch.cuda.current_stream().wait_stream(s)
if mode.endswith("graph"):
    for i in range(2):
        gr.replay()
        torch.cuda.synchronize()
        say("replay %d: equal to eager: %s" % (i, [torch.equal(a, b) for a, b in zip(got, want)]))
m.check_device()
say("ok")
dist.destroy_process_group()
