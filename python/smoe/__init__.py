"""smoe: a Mixture-of-Experts feed-forward layer for training (SonicMoE's
algorithm), over the C library libsmoe through ctypes.

    smoe.moe(x, router_w, w1, w2, top_k=2)        -> (out, expert_counts, router_logits)
    smoe.moe_general(x, tok, exp, score, w1, w2)  -> (out, expert_counts)
    smoe.MoE(num_experts, num_experts_per_tok, hidden_size, intermediate_size,
             activation_function, add_bias, std)   an nn.Module: forward -> (out, aux_loss)
                                                   [, router_logits with output_router_logits]
    smoe.router_z_loss(router_logits)              ST-MoE's z-loss: mean of logsumexp^2
    smoe.SmoeError                                 raised on bad input, with smoe_last_error()
                                                   (a ValueError too when Python found it)
    python -m smoe                                 versions, library, device, kernel path
    smoe.set_debug(True)                           CUDA: every call waits and raises its own
                                                   device-side error at once ($SMOE_DEBUG=1)
    smoe.check_device()                            CUDA: waits, raises an error the GPU found
    smoe.EPGroup(group), smoe.EPMoE(..., ep_group, max_tokens)
                                                   expert parallelism over torch.distributed;
                                                   smoe.MoE(..., ep_group=..., max_tokens=...)
                                                   makes an EPMoE, smoe.moe(..., ep_group=...)
                                                   runs this rank's experts
"""
from ._lib import SmoeError, library_path
from ._lib import version as library_version
from .functional import moe, moe_general, layer_info, set_debug, check_device, SmoeValueError
from .module import MoE, Experts, switch_load_balancing_loss, router_z_loss, load_hf_moe_weights
from .ep import EPGroup, EPMoE

__version__ = "0.4.0"

__all__ = ["moe", "moe_general", "MoE", "Experts", "SmoeError", "SmoeValueError",
           "switch_load_balancing_loss", "router_z_loss", "load_hf_moe_weights", "layer_info",
           "library_path", "library_version", "set_debug", "check_device", "EPGroup", "EPMoE"]
