"""smoe.EPMoE on the CPU: P ranks as P threads of this process over
smoe.EPGroup.in_process(P) (the library's in-process transport), in float64
against the PyTorch reference (reference.py) on the whole batch: output,
dx, the router's gradient summed over the ranks, every expert's weight
gradient, the expert counts and each rank's load-balancing loss.
tests/test_ep_gpu.py runs the same layer over NCCL."""
import threading

import pytest
import torch

import smoe
import reference as R
from test_functional import assert_close, make

E, D, N = 8, 16, 8
# Tokens per rank: unequal, one rank with none at P = 4.
SPLITS = {1: [12], 2: [7, 5], 4: [5, 0, 4, 3]}


def run_ranks(P, fn):
    """fn(rank, group) on P threads, one per rank of an in-process group;
    their results in rank order, or the first rank's failure raised."""
    groups = smoe.EPGroup.in_process(P)
    results, errors = [None] * P, [None] * P

    def main(r):
        try:
            results[r] = fn(r, groups[r])
        except BaseException as e:  # noqa: B902 (reported below)
            errors[r] = e
            groups[r]._threads.barrier.abort()   # the other ranks' all_reduce waits end

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a rank is still waiting (a collective another rank skipped)"
    for e in errors:
        if e is not None:
            raise e
    return results


def switch_ref(logits, counts):
    """The Switch loss in float64 from the reference's logits and counts."""
    p = torch.softmax(logits, -1).sum(0)
    f = counts.double() / counts.sum()
    return E * ((p / p.sum()) * f).sum()


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("routing", ["topk_softmax", "softmax_topk"])
def test_matches_reference(P, routing):
    split = SPLITS[P]
    T, K = sum(split), 2
    offs = [sum(split[:r]) for r in range(P + 1)]
    t = make(T, D, N, E, "swiglu", True, seed=0)
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def rank(r, group):
        _, wr, w1, w2, b1, b2 = t
        m = smoe.EPMoE(E, K, D, N, "swiglu", True, ep_group=group, max_tokens=max(split),
                       routing=routing).double()
        lo, hi = m.expert_start, m.expert_start + m.local_experts
        with torch.no_grad():
            for p, v in ((m.router.weight, wr), (m.c_fc.weight, w1[lo:hi]),
                         (m.c_proj.weight, w2[lo:hi]), (m.c_fc.bias, b1[lo:hi]),
                         (m.c_proj.bias, b2[lo:hi])):
                p.copy_(v)
        x = t[0][offs[r]:offs[r + 1]].clone().requires_grad_()
        out, aux = m(x)
        ((out * dout[offs[r]:offs[r + 1]]).sum() + 0.5 * aux).backward()
        m.reduce_router_grad()
        return (out.detach(), x.grad, m.router.weight.grad, m.c_fc.weight.grad,
                m.c_proj.weight.grad, aux.detach())

    res = run_ranks(P, rank)
    ins = [v.clone().requires_grad_() for v in t]
    out, counts, logits = R.moe_ref(*ins, top_k=K, routing=routing)
    aux = []
    for r in range(P):   # each rank's own loss: its tokens' logits and counts
        lg = logits[offs[r]:offs[r + 1]]
        rc = R.moe_ref(t[0][offs[r]:offs[r + 1]], *t[1:], top_k=K, routing=routing)[1]
        aux.append(switch_ref(lg, rc) if lg.shape[0] else lg.sum())
    ((out * dout).sum() + 0.5 * sum(aux)).backward()
    # (The F64 EP layer passes its scores to the experts as float32,
    # smoe.h: ~1e-7 from the reference, not 1e-12.)
    assert_close(torch.cat([v[0] for v in res]), out.detach(), 1e-6, "out")
    assert_close(torch.cat([v[1] for v in res]), ins[0].grad, 1e-6, "dx")
    for v in res:
        assert_close(v[2], ins[1].grad, 1e-6, "drouter_w")
    assert_close(torch.cat([v[3] for v in res]), ins[2].grad, 1e-6, "dw1")
    assert_close(torch.cat([v[4] for v in res]), ins[3].grad, 1e-6, "dw2")
    for r in range(P):
        assert_close(res[r][5].double(), aux[r].detach(), 1e-6, "rank %d's aux_loss" % r)


def test_experts_must_split_over_the_ranks():
    g = smoe.EPGroup.in_process(3)[0]
    with pytest.raises(smoe.SmoeError, match=r"num_experts = 8 cannot be split evenly over 3"):
        smoe.EPMoE(E, 2, D, N, ep_group=g, max_tokens=8)


def test_calls_refused():
    (g,) = smoe.EPGroup.in_process(1)
    m = smoe.EPMoE(E, 2, D, N, ep_group=g, max_tokens=4).double()
    x = torch.randn(4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"smoe.EPMoE: x \(hidden_states\) has shape \(4, 8\), "
                       r"its last dimension must be hidden_size = 16"):
        m(x[:, :8])
    with pytest.raises(ValueError, match=r"x \(hidden_states\) is cpu torch.float32 but the "
                       r"layer's parameters are cpu torch.float64"):
        m(x.float())
    with pytest.raises(smoe.SmoeError, match=r"5 tokens, more than max_tokens = 4"):
        m(torch.randn(5, D, dtype=torch.float64))
    m(x)
    m.float()   # the handle was made for float64
    with pytest.raises(ValueError, match=r"x is cpu torch.float32, but this layer runs on cpu "
                       r"torch.float64"):
        m(x.float())
