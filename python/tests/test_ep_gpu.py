"""smoe.EPMoE over torch.distributed (NCCL) on WORLD = 1 and 2 GPUs (each
skipped with fewer): each rank holds E / WORLD experts and T tokens; the
output, dx, the router's gradient (summed over ranks) and every expert's
weight gradient, gathered, against the plain PyTorch reference
(tests/reference.py, fp64 on the CPU) on the whole batch, by FA3's rule
with the single-GPU smoe layer's error as the bar; the expert counts
against the reference's. Cases: top-k softmax; sigmoid_topk with groups,
scaling and a non-zero expert bias; the router logits returned (and a loss
on them); the load-balancing loss over the group (every rank's equal to the
single-GPU layer's on the gathered batch, and its gradient). Two steps give
the same bits; the layer's forward and backward captured in a CUDA graph
replay them bit for bit. tests/test_ep.py checks the same on the CPU."""
import os
import tempfile

import pytest
import torch

import reference as R

WORLDS = (1, 2)
T, D, N, E = 96, 128, 64, 8
SIGMOID = dict(routing="sigmoid_topk", n_group=4, topk_group=2, routed_scaling=2.5)
# name: (K, EPMoE options, router weight scale, expert bias seed or None,
#        coefficient of aux_loss in each rank's loss)
CASES = {
    "topk_softmax": (2, {}, 0.5, None, 0.0),
    # (router weights small enough that sigmoid does not saturate: the
    # choice is the bias's and the scores', not rounding's)
    "sigmoid_topk": (3, SIGMOID, 0.1, 31, 0.0),
    "router_logits": (2, dict(output_router_logits=True), 0.5, None, 0.0),
    "group_loss": (3, dict(SIGMOID, aux_loss_scope="group", output_router_logits=True), 0.1,
                   32, 0.5),
}


def _inputs(world, case):
    """The whole layer's weights and the whole batch, bfloat16 on the CPU
    (dlog, the gradient of the router logits, float32)."""
    K, opts, scale, bias_seed, coef = CASES[case]
    g = torch.Generator().manual_seed(7)
    bf = torch.bfloat16
    wr = (torch.randn(E, D, generator=g) * scale).to(bf)
    w1 = (torch.randn(E, 2 * N, D, generator=g) * 0.1).to(bf)
    w2 = (torch.randn(E, D, N, generator=g) * 0.1).to(bf)
    x = torch.randn(world * T, D, generator=g).to(bf)
    do = torch.randn(world * T, D, generator=g).to(bf)
    dlog = torch.randn(world * T, E, generator=g) * 0.3
    bias = None
    if bias_seed is not None:
        bias = torch.randn(E, generator=torch.Generator().manual_seed(bias_seed)) * 0.3
    return wr, w1, w2, x, do, dlog, bias


def _backward(out, aux, logits, do, dlog, coef):
    """The gradients of sum(out * do) + sum(logits * dlog) (logits: None
    when not returned) + coef * aux."""
    tensors, grads = [out], [do]
    if logits is not None:
        tensors.append(logits)
        grads.append(dlog)
    if coef:
        tensors.append(aux)
        grads.append(torch.tensor(coef, dtype=aux.dtype, device=aux.device))
    torch.autograd.backward(tensors, grads)


def _run_case(rank, world, group, case):
    import torch.distributed as dist
    import smoe
    K, opts, _, _, coef = CASES[case]
    wr, w1, w2, x_all, do_all, dlog_all, bias = _inputs(world, case)
    El = E // world
    m = smoe.EPMoE(E, K, D, N, ep_group=group, max_tokens=T, **opts).cuda().to(torch.bfloat16)
    with torch.no_grad():
        m.router.weight.copy_(wr)
        m.c_fc.weight.copy_(w1[rank * El:(rank + 1) * El])
        m.c_proj.weight.copy_(w2[rank * El:(rank + 1) * El])
        if bias is not None:
            m.expert_bias.copy_(bias)   # replicated: the same on every rank
    assert m.expert_bias is None or m.expert_bias.dtype == torch.float32
    mine = slice(rank * T, (rank + 1) * T)
    x = x_all[mine].cuda().requires_grad_()
    do, dlog = do_all[mine].cuda(), dlog_all[mine].cuda()
    with_logits = opts.get("output_router_logits", False)

    def step():
        for p in list(m.parameters()) + [x]:
            p.grad = None
        res = m(x)
        assert len(res) == (3 if with_logits else 2)
        out, aux = res[0], res[1]
        logits = res[2] if with_logits else None
        _backward(out, aux, logits, do, dlog, coef)
        m.reduce_router_grad()
        return {"out": out.detach().clone(), "dx": x.grad.clone(),
                "dwr": m.router.weight.grad.clone(), "dw1": m.c_fc.weight.grad.clone(),
                "dw2": m.c_proj.weight.grad.clone(), "aux": aux.detach().clone(),
                "counts": m.last_expert_counts.clone(),
                "logits": logits.detach().clone() if with_logits else None}

    a = step()
    b = step()
    same = all(v is None or torch.equal(v, b[k]) for k, v in a.items())
    # A CUDA graph of the layer's forward and backward on a side stream
    # (the cases whose loss is sum(out * do) alone).
    graph_same = None
    if not with_logits and not coef:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            xs = x.detach().clone().requires_grad_()
            with torch.cuda.graph(gr, stream=s, capture_error_mode="thread_local"):
                out_g = m(xs)[0]
                gx, gw1, gw2, gwr = torch.autograd.grad(
                    out_g, [xs, m.c_fc.weight, m.c_proj.weight, m.router.weight], do)
        torch.cuda.current_stream().wait_stream(s)
        graph_same = True
        for _ in range(2):
            gr.replay()
            torch.cuda.synchronize()
            graph_same &= torch.equal(out_g, a["out"]) and torch.equal(gx, a["dx"])
            graph_same &= torch.equal(gw1, a["dw1"]) and torch.equal(gw2, a["dw2"])
    m.check_device()

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts).cpu()

    counts = a["counts"].clone()
    dist.all_reduce(counts)
    res = {"out": gather(a["out"]), "dx": gather(a["dx"]), "dwr": a["dwr"].cpu(),
           "dw1": gather(a["dw1"]), "dw2": gather(a["dw2"]), "aux": gather(a["aux"].reshape(1)),
           "counts": counts.cpu(), "same": same, "graph_same": graph_same, "path": m.path_name}
    if with_logits:
        res["logits"] = gather(a["logits"])
    if rank == 0:
        # the single-GPU layer on the whole batch, same weights, the loss
        # every rank's adds up to (each adds the group's aux loss)
        xg = x_all.cuda().requires_grad_()
        wrg, w1g, w2g = (t.cuda().requires_grad_() for t in (wr, w1, w2))
        kw = {k: v for k, v in opts.items() if k in SIGMOID}
        if bias is not None:
            kw["expert_bias"] = bias.cuda()
        o1, c1, l1 = smoe.moe(xg, wrg, w1g, w2g, top_k=K, **kw)
        aux1 = smoe.switch_load_balancing_loss(l1, c1)
        _backward(o1, aux1, l1 if with_logits else None, do_all.cuda(), dlog_all.cuda(),
                  world * coef)
        res["single"] = {"out": o1.detach().cpu(), "dx": xg.grad.cpu(), "dwr": wrg.grad.cpu(),
                         "dw1": w1g.grad.cpu(), "dw2": w2g.grad.cpu(), "logits": l1.detach().cpu(),
                         "aux": aux1.detach().cpu(), "counts": c1.cpu()}
    return res


def _worker(rank, world, init_file, out_file):
    import torch.distributed as dist
    import smoe
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    try:
        group = smoe.EPGroup()
        res = {case: _run_case(rank, world, group, case) for case in CASES}
        if rank == 0:
            torch.save(res, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


_RESULTS = {}


def _results(world):
    """Every case's results at `world` ranks, from one run of WORLD
    processes (kept for the other cases; a failure is raised by each)."""
    if world not in _RESULTS:
        import torch.multiprocessing as mp
        try:
            with tempfile.TemporaryDirectory() as tmp:
                init_file = os.path.join(tmp, "init")
                out_file = os.path.join(tmp, "res.pt")
                mp.spawn(_worker, args=(world, init_file, out_file), nprocs=world, join=True)
                _RESULTS[world] = torch.load(out_file)
        except Exception as e:
            _RESULTS[world] = e
    if isinstance(_RESULTS[world], Exception):
        raise _RESULTS[world]
    return _RESULTS[world]


def _reference(world, case):
    """The reference, fp64 on the CPU, on the bf16 values: the whole batch
    and the loss the ranks' losses add up to."""
    K, opts, _, _, coef = CASES[case]
    wr, w1, w2, x, do, dlog, bias = _inputs(world, case)
    wr, w1, w2, x = (t.double().requires_grad_() for t in (wr, w1, w2, x))
    if opts.get("routing") == "sigmoid_topk":
        out, counts, logits = R.moe_sigmoid_ref(
            x, wr, w1, w2, top_k=K, expert_bias=bias, n_group=opts["n_group"],
            topk_group=opts["topk_group"], routed_scaling=opts["routed_scaling"])
    else:
        out, counts, logits = R.moe_ref(x, wr, w1, w2, top_k=K)
    p = torch.softmax(logits, -1).sum(0)
    aux = E * ((p / p.sum()) * (counts.double() / counts.sum())).sum()
    loss = (out * do.double()).sum() + world * coef * aux
    if opts.get("output_router_logits"):
        loss = loss + (logits * dlog.double()).sum()
    loss.backward()
    return {"out": out.detach(), "dx": x.grad, "dwr": wr.grad, "dw1": w1.grad, "dw2": w2.grad,
            "logits": logits.detach(), "aux": aux.detach(), "counts": counts}


def _fa3(ep, single, ref, what):
    scale = ref.abs().max().item() + 1e-30
    err = (ep.double() - ref).abs().max().item() / scale
    bar = (single.double() - ref).abs().max().item() / scale
    assert err <= 2 * bar + 1e-2, "%s: EP err %.3g > 2 x %.3g (single GPU) + 1e-2" % (
        what, err, bar)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world", WORLDS)
def test_ep(world, case):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip("needs %d GPU%s" % (world, "s" if world > 1 else ""))
    res = _results(world)[case]
    single = res["single"]
    assert res["same"], "two steps gave different bits"
    if res["graph_same"] is not None:
        assert res["graph_same"], "the CUDA graph replay differs from the eager step"
    ref = _reference(world, case)
    assert torch.equal(res["counts"], ref["counts"]), (res["counts"], ref["counts"])
    assert torch.equal(single["counts"], ref["counts"]), (single["counts"], ref["counts"])
    for k in ("out", "dx", "dwr", "dw1", "dw2"):
        _fa3(res[k], single[k], ref[k], k)
    if "logits" in res:
        _fa3(res["logits"], single["logits"], ref["logits"], "router_logits")
    if CASES[case][1].get("aux_loss_scope") == "group":
        aux = res["aux"]
        assert torch.equal(aux, aux[:1].expand_as(aux)), "ranks' aux_loss differ: %s" % aux
        assert abs(aux[0].item() - single["aux"].item()) <= 1e-4 * abs(single["aux"].item()), (
            "aux_loss %r, the single-GPU layer's %r" % (aux[0].item(), single["aux"].item()))
        _fa3(aux[0], single["aux"], ref["aux"], "aux_loss")
