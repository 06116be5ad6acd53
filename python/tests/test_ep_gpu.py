"""smoe.EPMoE over torch.distributed on 2 GPUs (skipped with fewer): each rank
holds half the experts and half the tokens; the output, dx, the router's
gradient (summed over ranks) and every expert's weight gradient, gathered,
against the plain PyTorch reference (tests/reference.py, fp64 on the CPU)
on the whole batch, by FA3's rule with the single-GPU smoe layer's error
as the bar; two steps give the same bits; the layer's forward and backward
captured in a CUDA graph replay them bit for bit."""
import os
import tempfile

import pytest
import torch

import reference as R

WORLD = 2
T, D, N, E, K = 96, 128, 64, 8, 2


def _worker(rank, init_file, out_file):
    import torch.distributed as dist
    import smoe
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="file://" + init_file, rank=rank,
                            world_size=WORLD)
    try:
        g = torch.Generator().manual_seed(7)
        bf = torch.bfloat16
        wr = (torch.randn(E, D, generator=g) * 0.5).to(bf)
        w1 = (torch.randn(E, 2 * N, D, generator=g) * 0.1).to(bf)
        w2 = (torch.randn(E, D, N, generator=g) * 0.1).to(bf)
        x_all = torch.randn(WORLD * T, D, generator=g).to(bf)
        do_all = torch.randn(WORLD * T, D, generator=g).to(bf)
        El = E // WORLD
        group = smoe.EPGroup()
        m = smoe.EPMoE(E, K, D, N, ep_group=group, max_tokens=T).cuda().to(bf)
        with torch.no_grad():
            m.router.weight.copy_(wr)
            m.c_fc.weight.copy_(w1[rank * El:(rank + 1) * El])
            m.c_proj.weight.copy_(w2[rank * El:(rank + 1) * El])
        x = x_all[rank * T:(rank + 1) * T].cuda().requires_grad_()
        do = do_all[rank * T:(rank + 1) * T].cuda()

        def step():
            for p in list(m.parameters()) + [x]:
                p.grad = None
            out, _ = m(x)
            out.backward(do)
            m.reduce_router_grad()
            return [out.detach().clone(), x.grad.clone(), m.router.weight.grad.clone(),
                    m.c_fc.weight.grad.clone(), m.c_proj.weight.grad.clone()]

        a = step()
        b = step()
        same = all(torch.equal(u, v) for u, v in zip(a, b))
        # a CUDA graph of the layer's forward and backward on a side stream
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            xs = x.detach().clone().requires_grad_()
            with torch.cuda.graph(gr, stream=s, capture_error_mode="thread_local"):
                out_g, _ = m(xs)
                gx, gw1, gw2, gwr = torch.autograd.grad(
                    out_g, [xs, m.c_fc.weight, m.c_proj.weight, m.router.weight], do)
        torch.cuda.current_stream().wait_stream(s)
        graph_same = True
        for _ in range(2):
            gr.replay()
            torch.cuda.synchronize()
            graph_same &= torch.equal(out_g, a[0]) and torch.equal(gx, a[1])
            graph_same &= torch.equal(gw1, a[3]) and torch.equal(gw2, a[4])
        m.check_device()

        def gather(t):
            parts = [torch.empty_like(t) for _ in range(WORLD)]
            dist.all_gather(parts, t.contiguous())
            return torch.cat(parts).cpu()

        res = {"out": gather(a[0]), "dx": gather(a[1]), "dwr": a[2].cpu(),
               "dw1": gather(a[3]), "dw2": gather(a[4]), "same": same,
               "graph_same": graph_same, "path": m.path_name}
        if rank == 0:
            # the single-GPU layer on the whole batch, same weights
            xg = x_all.cuda().requires_grad_()
            wrg, w1g, w2g = (t.cuda().requires_grad_() for t in (wr, w1, w2))
            o1, _, _ = smoe.moe(xg, wrg, w1g, w2g, top_k=K)
            o1.backward(do_all.cuda())
            res["single"] = {"out": o1.detach().cpu(), "dx": xg.grad.cpu(), "dwr": wrg.grad.cpu(),
                             "dw1": w1g.grad.cpu(), "dw2": w2g.grad.cpu()}
            torch.save(res, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                    reason="needs 2 GPUs")
def test_ep_two_gpus():
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        out_file = os.path.join(tmp, "res.pt")
        mp.spawn(_worker, args=(init_file, out_file), nprocs=WORLD, join=True)
        res = torch.load(out_file)
    assert res["same"], "two steps gave different bits"
    assert res["graph_same"], "the CUDA graph replay differs from the eager step"
    # the reference, fp64 on the CPU, on the bf16 values
    g = torch.Generator().manual_seed(7)
    bf = torch.bfloat16
    wr = (torch.randn(E, D, generator=g) * 0.5).to(bf).double().requires_grad_()
    w1 = (torch.randn(E, 2 * N, D, generator=g) * 0.1).to(bf).double().requires_grad_()
    w2 = (torch.randn(E, D, N, generator=g) * 0.1).to(bf).double().requires_grad_()
    x = torch.randn(WORLD * T, D, generator=g).to(bf).double().requires_grad_()
    do = torch.randn(WORLD * T, D, generator=g).to(bf).double()
    out, _, _ = R.moe_ref(x, wr, w1, w2, top_k=K)
    out.backward(do)
    ref = {"out": out.detach(), "dx": x.grad, "dwr": wr.grad, "dw1": w1.grad, "dw2": w2.grad}
    for k, r in ref.items():
        scale = r.abs().max().item() + 1e-30
        err = (res[k].double() - r).abs().max().item() / scale
        bar = (res["single"][k].double() - r).abs().max().item() / scale
        assert err <= 2 * bar + 1e-2, "%s: EP err %.3g > 2 x %.3g (single GPU) + 1e-2" % (
            k, err, bar)
