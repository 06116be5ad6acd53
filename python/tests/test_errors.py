"""Bad input raises smoe.SmoeError with a message saying what was wrong:
from the Python checks (shapes, dtypes, devices, names) or from the library
(smoe_last_error(), with its status), and nothing is left broken after it."""
import pytest
import torch

import smoe
from smoe import _lib as L
from test_functional import make


@pytest.fixture
def t():
    return make(T=6, d=8, n=4, E=4, act="swiglu", bias=True, seed=0)


def test_shape_mismatches(t):
    x, r, w1, w2, b1, b2 = t
    with pytest.raises(smoe.SmoeError, match=r"w1 has shape \(4, 8, 7\)") as e:
        smoe.moe(x, r, w1[:, :, :7], w2, top_k=2)
    assert e.value.status == L.SMOE_ERROR_INVALID_SIZE
    with pytest.raises(smoe.SmoeError, match="router_w has shape"):
        smoe.moe(x, r[:3], w1, w2, top_k=2)
    with pytest.raises(smoe.SmoeError, match="w2 has shape"):
        smoe.moe(x, r, w1, w2[:, :5], top_k=2)
    with pytest.raises(smoe.SmoeError, match="b1 has shape"):
        smoe.moe(x, r, w1, w2, b1[:, :3], b2, top_k=2)
    with pytest.raises(smoe.SmoeError, match="w1 has shape"):
        # a non-gated activation wants (E, n, d)
        smoe.moe(x, r, w1, w2, top_k=2, activation="relu")
    with pytest.raises(smoe.SmoeError, match="3 dimensions"):
        smoe.moe(x, r, w1[0], w2, top_k=2)


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
