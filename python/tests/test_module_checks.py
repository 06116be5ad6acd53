"""smoe.MoE checks its arguments when it is built and x when it is called,
with messages that name the argument or the tensor; SonicMoE's call style
layer(x, kernel_backend_moe) works, and a bool there (the old smoe
is_inference_mode position) is refused."""
import enum

import pytest
import torch

import smoe
from smoe import _lib as L


class KernelBackendMoE(enum.Enum):   # as sonicmoe.enums spells it
    scattermoe = "scattermoe"
    torch = "torch"
    sonicmoe = "sonicmoe"


@pytest.mark.parametrize("args,kw,match", [
    ((8, 9, 16, 12), {}, r"smoe.MoE: num_experts_per_tok = 9, must be in \[1, num_experts = 8\]"),
    ((8, 0, 16, 12), {}, r"num_experts_per_tok = 0, must be in \[1, num_experts = 8\]"),
    ((0, 1, 16, 12), {}, r"smoe.MoE: num_experts = 0, must be >= 1"),
    ((-2, 1, 16, 12), {}, r"num_experts = -2, must be >= 1"),
    ((8, 2, 0, 12), {}, r"hidden_size = 0, must be >= 1"),
    ((8, 2, 16, -1), {}, r"intermediate_size = -1, must be >= 1"),
    ((8, 2.0, 16, 12), {}, r"num_experts_per_tok = 2.0, must be an int"),
    ((True, 1, 16, 12), {}, r"num_experts = True, must be an int"),
    ((8, 2, 16, 12, "swish"), {}, r"activation_function = 'swish', must be one of 'swiglu'"),
    ((8, 2, 16, 12), {"routing": "topk"}, r"routing = 'topk', must be one of 'topk_softmax'"),
    ((8, 2, 16, 12), {"routing": "general"}, r"routing = 'general' .* smoe.moe_general"),
    ((8, 2, 16, 12), {"token_rounding": "upward"}, r"token_rounding = 'upward', must be one of"),
    ((8, 2, 16, 12), {"w1_layout": "fused"}, r"w1_layout = 'fused', must be one of"),
    ((8, 2, 16, 12), {"round_tile": 0}, r"round_tile = 0, must be >= 1"),
    ((8, 2, 16, 12, "swiglu", False, -0.1), {}, r"std = -0.1, must be a finite number >= 0"),
])
def test_constructor_rejects(args, kw, match):
    with pytest.raises(ValueError, match=match) as e:
        smoe.MoE(*args, **kw)
    assert isinstance(e.value, smoe.SmoeError)   # the package's error type too


def test_constructor_accepts_edges():
    m = smoe.MoE(4, 4, 8, 4)                     # K = E
    assert m.top_k == 4
    m = smoe.MoE(1, 1, 8, 4, std=None)           # one expert; default init
    assert m.num_experts == 1


def test_functional_names_raise_value_error_too():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"activation = 'swish'"):
        smoe.moe(x, torch.randn(4, 8), torch.randn(4, 8, 8), torch.randn(4, 8, 4), top_k=2,
                 activation="swish")


@pytest.fixture
def layer():
    torch.manual_seed(0)
    return smoe.MoE(4, 2, 8, 6, "swiglu", True, 0.3)


@pytest.mark.parametrize("backend", [KernelBackendMoE.sonicmoe, KernelBackendMoE.torch,
                                     "sonicmoe", "SONICMOE", None])
def test_kernel_backend_positional(layer, backend):
    # SonicMoE's forward(hidden_states, kernel_backend_moe, is_inference_mode):
    # the backend is accepted and smoe's own kernels run; the result is the
    # same as without it.
    x = torch.randn(5, 8)
    out, aux = layer(x)
    out2, aux2 = layer(x, backend)
    assert torch.equal(out, out2) and torch.equal(aux, aux2)
    out3, aux3 = layer(x, backend, True)         # third positional: is_inference_mode
    assert torch.equal(out, out3) and aux3 is None


def test_kernel_backend_refusals(layer):
    x = torch.randn(5, 8)
    for flag in (True, False):
        # The old smoe.MoE took is_inference_mode second: refused, not misread.
        with pytest.raises(TypeError, match=r"second positional argument is kernel_backend_moe.*"
                           r"is_inference_mode=%s by keyword" % flag):
            layer(x, flag)
    with pytest.raises(ValueError, match=r"kernel_backend_moe = 'triton', must be None or one "
                       r"of SonicMoE's KernelBackendMoE"):
        layer(x, "triton")
    with pytest.raises(ValueError, match=r"kernel_backend_moe = 1"):
        layer(x, 1)


def test_forward_names_the_wrong_tensor(layer):
    x = torch.randn(5, 8)
    with pytest.raises(TypeError, match=r"hidden_states \(x\) must be a torch.Tensor, got list"):
        layer([[0.0] * 8])
    with pytest.raises(ValueError, match=r"x \(hidden_states\) has shape \(5, 7\), its last "
                       r"dimension must be hidden_size = 8") as e:
        layer(x[:, :7])
    assert e.value.status == L.SMOE_ERROR_INVALID_SIZE
    with pytest.raises(ValueError, match=r"x \(hidden_states\) has shape \(\), its last"):
        layer(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"x \(hidden_states\) has dtype torch.float64 but the "
                       r"layer's parameters have torch.float32"):
        layer(x.double())
    with pytest.raises(ValueError, match=r"x \(hidden_states\) is on meta but the layer's "
                       r"parameters are on cpu"):
        layer(x.to("meta"))
    layer.router.weight.data = layer.router.weight.data.double()
    with pytest.raises(ValueError, match=r"router.weight has dtype torch.float64 but c_fc.weight "
                       r"has torch.float32"):
        layer(x)
    # Under autocast every input is cast to one dtype: mixed dtypes are fine.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = layer(x.double())
    assert out.dtype == torch.bfloat16


def test_ep_module_checks_sizes_before_any_communication():
    with pytest.raises(ValueError, match=r"smoe.EPMoE: num_experts_per_tok = 5, must be in "
                       r"\[1, num_experts = 4\]"):
        smoe.EPMoE(4, 5, 8, 6, ep_group=object(), max_tokens=8)
