"""bench/kernel_map.py groups a committed compare.py --kernels profile as its
lines say (gpt-oss-120b's shape, H200, session 40)."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "kernel_map.py")
PROFILE = os.path.join(ROOT, "bench", "results", "kernels_h200_2026-11-29_6321982.txt")


@pytest.mark.skipif(not (os.path.exists(SCRIPT) and os.path.exists(PROFILE)),
                    reason="needs the repository's bench/ (not in an installed package)")
def test_kernel_map_groups_the_profile():
    spec = importlib.util.spec_from_file_location("kernel_map", SCRIPT)
    km = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(km)
    data = km.parse(PROFILE, "forward+backward")
    shape = ("16384", "2880", "2880", "128", "4")
    smoe, sonic = data[(shape, "smoe-sm90-consume-lp")], data[(shape, "sonicmoe")]
    # the profile's lines: vk_varlen_k_kernel 6908.1 us (2 launches: dW1, dW2);
    # k_aggregate_forward_kc 113.3 + k_aggregate_backward_kc 162.5
    assert smoe["dw"] == pytest.approx(6908.1)
    assert smoe["agg"] == pytest.approx(113.3 + 162.5)
    assert {"up", "down", "dh", "dxt"} <= set(smoe)
    # SonicMoE's dW1 and dW2 share one QuACK config: one entry of 2 launches
    assert (5471.6, 2.0) in sonic["gemms"]
    assert "dw" not in sonic and sonic["dh"] > 0
    forward = km.parse(PROFILE, "forward")[(shape, "smoe-sm90-consume-lp")]
    assert "dw" not in forward and "dh" not in forward
