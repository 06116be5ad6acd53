"""Bad input raises smoe.SmoeError with a message saying what was wrong:
from the Python checks (shapes, dtypes, devices, names) or from the library
(smoe_last_error(), with its status), and nothing is left broken after it."""
import pytest
import torch

import smoe
from smoe import _lib as L
from test_functional import assert_close, make


@pytest.fixture
def t():
    return make(T=6, d=8, n=4, E=4, act="swiglu", bias=True, seed=0)


def test_shape_mismatches(t):
    # d, n and E come from w1 and w2, checked against each other first; the
    # message names both with their shapes and the size that disagrees.
    x, r, w1, w2, b1, b2 = t   # d = 8, n = 4, E = 4, swiglu: w1 (4, 8, 8), w2 (4, 8, 4)
    with pytest.raises(smoe.SmoeError, match=r"w1 has shape \(4, 8, 7\) but w2 has shape "
                       r"\(4, 8, 4\): d = 7 in w1 \(its last dimension\) but 8 in w2") as e:
        smoe.moe(x, r, w1[:, :, :7], w2, top_k=2)
    assert e.value.status == L.SMOE_ERROR_INVALID_SIZE
    with pytest.raises(smoe.SmoeError, match=r"w2 has shape \(4, 5, 4\): d = 8 in w1"):
        smoe.moe(x, r, w1, w2[:, :5], top_k=2)
    with pytest.raises(smoe.SmoeError, match=r"w2 has shape \(3, 8, 4\): E = 4 experts in w1 "
                       r"\(its first dimension\) but 3 in w2"):
        smoe.moe(x, r, w1, w2[:3], top_k=2)
    with pytest.raises(smoe.SmoeError, match=r"w2 has n = 3 \(its last dimension\), so w1 must "
                       r"have 6 rows per expert \(2n: a gated activation\), not 8"):
        smoe.moe(x, r, w1, w2[:, :, :3], top_k=2)
    with pytest.raises(smoe.SmoeError, match=r"w1 has shape \(4, 8, 8\) but w2 has shape "
                       r"\(4, 8, 4\): w2 has n = 4 .* must have 4 rows per expert \(n: an "
                       r"activation that is not gated\), not 8"):
        # a non-gated activation wants (E, n, d)
        smoe.moe(x, r, w1, w2, top_k=2, activation="relu")
    with pytest.raises(smoe.SmoeError, match=r"b1 has shape \(4, 3\), expected \(4, 8\)"):
        smoe.moe(x, r, w1, w2, b1[:, :3], b2, top_k=2)
    with pytest.raises(smoe.SmoeError, match=r"b2 has shape \(4, 7\), expected \(4, 8\)"):
        smoe.moe(x, r, w1, w2, b1, b2[:, :7], top_k=2)
    with pytest.raises(smoe.SmoeError, match="w1 has shape .*, must have 3 dimensions"):
        smoe.moe(x, r, w1[0], w2, top_k=2)


def test_wrong_hidden_size_is_reported_as_x(t):
    # x is checked against d of w1 and w2, and named.
    x, r, w1, w2, _, _ = t
    with pytest.raises(smoe.SmoeError, match=r"^SMOE_ERROR_INVALID_SIZE: x has hidden size 7 "
                       r"\(shape \(6, 7\)\), but w1 and w2 have d = 8$") as e:
        smoe.moe(x[:, :7], r, w1, w2, top_k=2)
    assert e.value.status == L.SMOE_ERROR_INVALID_SIZE
    with pytest.raises(smoe.SmoeError, match=r"x has hidden size 9 \(shape \(2, 3, 9\)\), but "
                       r"w1 and w2 have d = 8"):
        smoe.moe(torch.zeros(2, 3, 9, dtype=x.dtype), r, w1, w2, top_k=2)
    tok = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(smoe.SmoeError, match=r"x has hidden size 7 .*, but w1 and w2 have d = 8"):
        smoe.moe_general(x[:, :7], tok, tok, torch.ones(2), w1, w2)


def test_wrong_router_shape_is_reported_as_router_w(t):
    x, r, w1, w2, _, _ = t
    with pytest.raises(smoe.SmoeError, match=r"router_w has shape \(3, 8\), expected \(4, 8\) "
                       r"\(E = 4, d = 8 from w1 and w2\)") as e:
        smoe.moe(x, r[:3], w1, w2, top_k=2)
    assert e.value.status == L.SMOE_ERROR_INVALID_SIZE
    with pytest.raises(smoe.SmoeError, match=r"router_w has shape \(4, 7\), expected \(4, 8\)"):
        smoe.moe(x, r[:, :7], w1, w2, top_k=2)
    with pytest.raises(smoe.SmoeError, match=r"router_w has shape \(32,\), must have 2 dimensions"):
        smoe.moe(x, r.flatten(), w1, w2, top_k=2)


def test_dtypes_and_devices(t):
    x, r, w1, w2, _, _ = t
    with pytest.raises(smoe.SmoeError, match="float16") as e:
        smoe.moe(x.half(), r.half(), w1.half(), w2.half(), top_k=2)
    assert e.value.status == L.SMOE_ERROR_INVALID_VALUE
    with pytest.raises(smoe.SmoeError, match="w2 has dtype torch.float32 but x has torch.float64"):
        smoe.moe(x, r, w1, w2.float(), top_k=2)
    with pytest.raises(smoe.SmoeError, match="meta"):
        smoe.moe(x, r, w1.to("meta"), w2, top_k=2)


def test_bad_options(t):
    x, r, w1, w2, _, _ = t
    for kw, msg in ((dict(top_k=0), "top_k = 0"), (dict(top_k=5), r"top_k = 5, must be an int in \[1, E = 4\]"),
                    (dict(top_k=2, activation="tanh"), "activation = 'tanh'"),
                    (dict(top_k=2, routing="expert_choice"), "routing = 'expert_choice'"),
                    (dict(top_k=2, routing="general"), "moe_general"),
                    (dict(top_k=2, w1_layout="split"), "w1_layout = 'split'"),
                    (dict(top_k=2, token_rounding="sideways"), "token_rounding = 'sideways'")):
        with pytest.raises(smoe.SmoeError, match=msg):
            smoe.moe(x, r, w1, w2, **kw)


def test_library_messages_reach_python(t):
    x, r, w1, w2, _, _ = t
    # Checked by the C library: its smoe_last_error() is the message.
    with pytest.raises(smoe.SmoeError, match=r"round_tile = 0") as e:
        smoe.moe(x, r, w1, w2, top_k=2, token_rounding="up", round_tile=0)
    assert e.value.status == L.SMOE_ERROR_INVALID_SIZE
    with pytest.raises(smoe.SmoeError, match=r"T = 0\b"):
        smoe.moe(x[:0], r, w1, w2, top_k=2)
    # And a good call right after works.
    out, _, _ = smoe.moe(x, r, w1, w2, top_k=2)
    assert torch.isfinite(out).all()


def test_general_triples_checked(t):
    x, _, w1, w2, _, _ = t
    s = torch.ones(3)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(smoe.SmoeError, match=r"pair_token\[1\] = 9\b"):
        smoe.moe_general(x, i32([0, 9, 9]), i32([0, 1, 2]), s, w1, w2)
    with pytest.raises(smoe.SmoeError, match=r"pair_expert\[2\] = 4\b"):
        smoe.moe_general(x, i32([0, 1, 2]), i32([0, 1, 4]), s, w1, w2)
    with pytest.raises(smoe.SmoeError, match="sorted by token"):
        smoe.moe_general(x, i32([2, 1, 3]), i32([0, 1, 2]), s, w1, w2)
    with pytest.raises(smoe.SmoeError, match="given twice"):
        smoe.moe_general(x, i32([1, 1, 3]), i32([2, 2, 2]), s, w1, w2)
    with pytest.raises(smoe.SmoeError, match="not finite"):
        smoe.moe_general(x, i32([0, 1, 3]), i32([0, 1, 2]), torch.tensor([1.0, float("nan"), 1.0]),
                         w1, w2)
    with pytest.raises(smoe.SmoeError, match="pair_score has dtype torch.float64"):
        smoe.moe_general(x, i32([0, 1, 3]), i32([0, 1, 2]), s.double(), w1, w2)
    with pytest.raises(smoe.SmoeError, match="3, 2, 3 entries"):
        smoe.moe_general(x, i32([0, 1, 3]), i32([0, 1]), s, w1, w2)


@pytest.mark.parametrize("validate", [None, True])
def test_general_triples_checked_in_python_too(t, validate):
    # validate=True runs the same checks in torch (for CUDA tensors, where
    # the library cannot check before the kernels run).
    x, _, w1, w2, _, _ = t
    s = torch.ones(3)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    for tok, exp, msg in (([0, 9, 9], [0, 1, 2], r"pair_token\[1\] = 9"),
                          ([0, 1, 2], [0, 1, 4], r"pair_expert\[2\] = 4"),
                          ([2, 1, 3], [0, 1, 2], "sorted by token"),
                          ([1, 1, 3], [2, 2, 2], r"\(token 1, expert 2\) is given twice")):
        with pytest.raises(smoe.SmoeError, match=msg):
            smoe.moe_general(x, i32(tok), i32(exp), s, w1, w2, validate=validate)


def test_backward_after_inference(t):
    x, r, w1, w2, _, _ = [v.clone().requires_grad_() if v is not None else None for v in t]
    out, _, _ = smoe.moe(x, r, w1, w2, top_k=2, inference=True)
    with pytest.raises(smoe.SmoeError, match="inference=True"):
        out.sum().backward()


def test_non_contiguous_inputs_are_fine(t):
    x, r, w1, w2, b1, b2 = t
    ref, _, _ = smoe.moe(x, r, w1, w2, b1, b2, top_k=2)
    xt = x.t().contiguous().t()            # same values, column-major strides
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)
    assert not xt.is_contiguous() and not w1t.is_contiguous()
    out, _, _ = smoe.moe(xt, r, w1t, w2, b1, b2, top_k=2)
    assert torch.equal(out, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_wants_bf16(t):
    x, r, w1, w2, _, _ = [v.cuda().float() if v is not None else None for v in t]
    with pytest.raises(smoe.SmoeError):
        smoe.moe(x, r, w1, w2, top_k=2)


def test_error_carries_status_name():
    e = smoe.SmoeError(L.SMOE_ERROR_UNSUPPORTED, "because")
    assert e.status_name == "SMOE_ERROR_UNSUPPORTED" and str(e) == "SMOE_ERROR_UNSUPPORTED: because"
    assert isinstance(e, RuntimeError)


# ------------------------------------------------------------ device-side errors

def test_debug_and_check_device_on_cpu(t, monkeypatch):
    # The CPU backend checks everything before any work: check_device() and
    # debug mode have nothing to add, and bad triples raise at once anyway.
    from smoe import functional as fn
    monkeypatch.setattr(fn, "_DEBUG", False)
    x, r, w1, w2, _, _ = t
    assert smoe.check_device() is None
    assert smoe.set_debug(True) is None
    assert fn._DEBUG is True
    out, _, _ = smoe.moe(x, r, w1, w2, top_k=2)
    assert torch.isfinite(out).all()
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(smoe.SmoeError, match=r"pair_expert\[2\] = 4\b"):
        smoe.moe_general(x, i32([0, 1, 2]), i32([0, 1, 4]), torch.ones(3), w1, w2)
    assert smoe.check_device() is None
    assert smoe.set_debug(False) is None
    assert fn._DEBUG is False


@pytest.mark.parametrize("value,on", [("1", True), ("0", False)])
def test_debug_from_environment(value, on):
    import os
    import subprocess
    import sys
    env = dict(os.environ, SMOE_DEBUG=value)
    root = os.path.dirname(os.path.dirname(os.path.abspath(smoe.__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    got = subprocess.run([sys.executable, "-c", "import smoe.functional as f; print(f._DEBUG)"],
                         env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert got == str(on)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def gpu(monkeypatch):
    """bfloat16 CUDA tensors (d, n multiples of 8), debug mode off, and no
    device error left over from an earlier test."""
    from smoe import functional as fn
    monkeypatch.setattr(fn, "_DEBUG", False)
    smoe.check_device()
    x, r, w1, w2, _, _ = make(T=16, d=32, n=16, E=4, act="swiglu", bias=False, seed=3)
    yield [v.cuda().to(torch.bfloat16) for v in (x, r, w1, w2)]
    smoe.check_device()


def _i32(v):
    return torch.tensor(v, dtype=torch.int32, device="cuda")


# (pair_token, pair_expert, pair_score, the device's message) for T = 16, E = 4.
BAD_TRIPLES = [
    ([0, 1, 2], [0, 1, 4], [1.0, 1.0, 1.0], r"pair_expert\[2\] = 4, must be in \[0, E = 4\)"),
    ([0, 1, 16], [0, 1, 2], [1.0, 1.0, 1.0], r"pair_token\[2\] = 16, must be in \[0, T = 16\)"),
    ([0, 2, 1], [0, 1, 2], [1.0, 1.0, 1.0], "must be sorted by token"),
    ([0, 1, 1], [0, 3, 3], [1.0, 1.0, 1.0], r"\(token 1, expert 3\) is given twice"),
    ([0, 1, 2], [0, 1, 2], [1.0, float("nan"), 1.0], r"pair_score\[1\] = nan is not finite"),
    ([0, 1, 2], [0, 1, 2], [1.0, 1.0, float("-inf")], r"pair_score\[2\] = -inf is not finite"),
]
GOOD = ([0, 1, 2], [0, 1, 2], [1.0, 0.5, 2.0])


def _general(x, w1, w2, triple, **kw):
    tok, exp, score = triple[:3]
    return smoe.moe_general(x, _i32(tok), _i32(exp), torch.tensor(score, device="cuda"), w1, w2,
                            **kw)


def _check_good_call(x, w1, w2):
    """A good call on the same layer runs and agrees with the CPU."""
    out, _ = _general(x, w1, w2, GOOD)
    tok, exp, score = GOOD
    ref, _ = smoe.moe_general(x.cpu().double(), torch.tensor(tok, dtype=torch.int32),
                              torch.tensor(exp, dtype=torch.int32), torch.tensor(score),
                              w1.cpu().double(), w2.cpu().double())
    assert_close(out.double().cpu(), ref, 2e-2, "out after the error")


@cuda
@pytest.mark.parametrize("bad", BAD_TRIPLES, ids=["expert", "token", "unsorted", "twice",
                                                  "nan_score", "inf_score"])
def test_cuda_bad_triple_raises_at_next_call(gpu, bad):
    x, _, w1, w2 = gpu
    _general(x, w1, w2, bad)          # queued: the device finds the error
    torch.cuda.synchronize()          # (the next call sees it once that kernel finished)
    with pytest.raises(smoe.SmoeError, match=bad[3] + r".*nothing written \(found on the device "
                       r"in an earlier call of this layer; this call was not run\)") as e:
        _general(x, w1, w2, GOOD)
    assert e.value.status == L.SMOE_ERROR_INVALID_VALUE
    # Raised once (the read clears it): the next call runs and is right.
    _check_good_call(x, w1, w2)
    assert smoe.check_device() is None


@cuda
@pytest.mark.parametrize("bad", BAD_TRIPLES[:1] + BAD_TRIPLES[4:5], ids=["expert", "score"])
def test_cuda_bad_triple_raises_at_once_in_debug_mode(gpu, bad):
    x, _, w1, w2 = gpu
    smoe.set_debug(True)
    with pytest.raises(smoe.SmoeError, match=bad[3] + "; nothing written$") as e:
        _general(x, w1, w2, bad)
    assert e.value.status == L.SMOE_ERROR_INVALID_VALUE
    _check_good_call(x, w1, w2)
    smoe.set_debug(False)


@cuda
def test_cuda_validate_raises_before_the_call(gpu):
    x, _, w1, w2 = gpu
    with pytest.raises(smoe.SmoeError, match=BAD_TRIPLES[0][3]):
        _general(x, w1, w2, BAD_TRIPLES[0], validate=True)
    assert smoe.check_device() is None   # the library never saw it


@cuda
def test_cuda_check_device(gpu):
    x, _, w1, w2 = gpu
    _general(x, w1, w2, BAD_TRIPLES[0])
    with pytest.raises(smoe.SmoeError, match=BAD_TRIPLES[0][3]):
        smoe.check_device()            # waits for the device
    assert smoe.check_device() is None
    _check_good_call(x, w1, w2)


@cuda
def test_cuda_backward_of_a_failed_forward(gpu):
    x, _, w1, w2 = gpu
    x = x.clone().requires_grad_()
    out, _ = _general(x, w1, w2, BAD_TRIPLES[0])
    torch.cuda.synchronize()
    # The forward's own error, raised before the backward runs.
    with pytest.raises(smoe.SmoeError, match=BAD_TRIPLES[0][3]):
        out.sum().backward(retain_graph=True)
    # Read it first: the backward then runs, and its device check refuses
    # the saved block of the failed forward.
    out.sum().backward()
    with pytest.raises(smoe.SmoeError, match="the forward that filled the saved block failed a "
                       "device-side check"):
        smoe.check_device()
    assert smoe.check_device() is None


def _offset_copy(t, k):
    """A copy of t that is a view k elements into a larger buffer (for
    bfloat16 and k = 1: data_ptr() % 16 == 2)."""
    flat = torch.zeros(t.numel() + 16, dtype=t.dtype, device=t.device)
    v = flat[k:k + t.numel()].view(t.shape)
    v.copy_(t)
    return flat, v


@cuda
@pytest.mark.parametrize("k", [1, 3, 5])
def test_cuda_misaligned_views_work(gpu, k):
    # The GPU kernels need 16-byte aligned tensors; the package passes views
    # at other offsets as aligned copies, so the results are the same.
    x, r, w1, w2 = gpu
    dout = torch.randn_like(x)
    ref_in = [v.clone().requires_grad_() for v in (x, r, w1, w2)]
    out, counts, logits = smoe.moe(*ref_in, top_k=2, routing="softmax_topk")
    (out * 1).backward(dout)
    bases = [_offset_copy(v, k)[0].requires_grad_() for v in (x, r, w1, w2)]
    views = [b[k:k + v.numel()].view(v.shape) for b, v in zip(bases, (x, r, w1, w2))]
    assert all(v.data_ptr() % 16 == 2 * k for v in views)
    _, dout_v = _offset_copy(dout, k)
    assert dout_v.data_ptr() % 16 == 2 * k
    out_v, counts_v, logits_v = smoe.moe(*views, top_k=2, routing="softmax_topk")
    out_v.backward(dout_v)
    assert torch.equal(counts_v, counts)
    assert_close(out_v.double(), out.double(), 1e-2, "out")
    assert_close(logits_v.double(), logits.double(), 1e-6, "router_logits")
    for name, b, v, a in zip(("x", "router_w", "w1", "w2"), bases, (x, r, w1, w2), ref_in):
        g = b.grad[k:k + v.numel()].view(v.shape)
        assert_close(g.double(), a.grad.double(), 1e-2, "grad " + name)
    # GENERAL: int32 / fp32 triples at a 4-byte offset, x and w1 misaligned.
    tok, exp = _i32([0, 1, 1, 5]), _i32([3, 0, 2, 1])
    score = torch.tensor([1.0, 0.5, 0.25, 2.0], device="cuda")
    _, tok_v = _offset_copy(tok, 1)
    _, exp_v = _offset_copy(exp, 3)
    _, score_v = _offset_copy(score, 1)
    ref, _ = smoe.moe_general(x, tok, exp, score, w1, w2)
    got, _ = smoe.moe_general(views[0].detach(), tok_v, exp_v, score_v, views[2].detach(), w2)
    assert_close(got.double(), ref.double(), 1e-2, "general out")
    assert smoe.check_device() is None
