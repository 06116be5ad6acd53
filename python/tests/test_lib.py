"""The ctypes mirror (smoe/_lib.py) against include/smoe.h: the header is
parsed for its structs, fields, enums and functions, a small C program
compiled here prints every struct's size and every field's offset and every
enum constant's value, and all of it must match the mirror exactly."""
import ctypes
import os
import re
import shutil
import subprocess

import pytest

from smoe import _lib as L

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER = os.path.join(ROOT, "include", "smoe.h")

pytestmark = pytest.mark.skipif(not os.path.exists(HEADER),
                                reason="include/smoe.h not found (not a source checkout)")


def header_text():
    text = open(HEADER).read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def parse_structs(text):
    """{struct name: [field names]} for every `typedef struct x {...} x;`."""
    out = {}
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        fields = []
        for decl in m.group(2).split(";"):
            decl = decl.strip()
            if not decl:
                continue
            # "const int32_t *a, *b" -> a, b ; "int64_t T" -> T
            first, *rest = decl.split(",")
            names = [re.search(r"(\w+)\s*$", first).group(1)]
            names += [re.sub(r"[\s*]", "", r) for r in rest]
            fields.extend(names)
        out[m.group(3)] = fields
    return out


def parse_enums(text):
    """{enum name: [constant names]}"""
    out = {}
    for m in re.finditer(r"typedef\s+enum\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        names = [re.match(r"\s*(\w+)", c).group(1) for c in m.group(2).split(",") if c.strip()]
        out[m.group(3)] = names
    return out


def parse_functions(text):
    return set(re.findall(r"SMOE_API\s+[\w\s\*]*?\b(smoe_\w+)\s*\(", text))


def test_struct_fields_match_header():
    structs = parse_structs(header_text())
    assert set(structs) == set(L.STRUCTS), "structs in smoe.h vs _lib.STRUCTS"
    for name, fields in structs.items():
        mine = [f[0] for f in L.STRUCTS[name]._fields_]
        assert mine == fields, name


def test_enum_names_match_header():
    enums = parse_enums(header_text())
    assert set(enums) == set(L.ENUMS)
    for name, consts in enums.items():
        assert list(L.ENUMS[name]) == consts, name


def test_functions_match_header():
    assert parse_functions(header_text()) == set(L.FUNCTION_NAMES)


def parse_signatures(text):
    """{function name: (return type, [parameter types])}, each type as a C
    spelling without const and names: 'pointer' for any pointer."""
    def ctype(decl, named):
        if "*" in decl:
            return "pointer"
        words = decl.replace("const", " ").split()
        return " ".join(words[:-1] if named else words)

    out = {}
    for m in re.finditer(r"SMOE_API\s+([\w\s\*]*?)\b(smoe_\w+)\s*\(([^)]*)\)\s*;", text):
        params = [p.strip() for p in m.group(3).split(",")]
        if params == ["void"]:
            params = []
        out[m.group(2)] = (ctype(m.group(1), False), [ctype(p, True) for p in params])
    return out


def ctypes_kind(t):
    """The C spelling a ctypes type stands for, as parse_signatures gives it
    (an enum and a struct by their names)."""
    if t is None:
        return "void"
    if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, ctypes._Pointer):
        return "pointer"
    for name, cls in L.STRUCTS.items():
        if t is cls:
            return name
    return {ctypes.c_size_t: "size_t", ctypes.c_int64: "int64_t", ctypes.c_int: "int"}[t]


def c_kind(spelling):
    """An enum's typedef name as the int it is passed as."""
    return "int" if spelling in L.ENUMS else spelling


def test_function_signatures_match_header():
    # Every function's return type and parameter types (pointer, size_t,
    # int64_t, int or enum) as the header declares them: a parameter added,
    # removed or retyped in smoe.h fails here.
    sigs = parse_signatures(header_text())
    assert set(sigs) == set(L.FUNCTION_NAMES)
    for name, (ret, params) in sigs.items():
        restype, argtypes = L._FUNCTIONS[name]
        assert c_kind(ctypes_kind(restype)) == c_kind(ret), name
        assert [c_kind(ctypes_kind(t)) for t in argtypes] == [c_kind(p) for p in params], name
    L.lib()
    for name, raw in (("smoe_layer_forward", L.forward_raw),
                      ("smoe_layer_backward", L.backward_raw)):
        assert [c_kind(ctypes_kind(t)) for t in raw.argtypes] == \
            [c_kind(p) for p in sigs[name][1]], name


def test_version_matches_header():
    text = open(HEADER).read()
    v = tuple(int(re.search(r"#define SMOE_VERSION_%s (\d+)" % k, text).group(1))
              for k in ("MAJOR", "MINOR", "PATCH"))
    assert v == L.VERSION
    assert L.version() == "%d.%d.%d" % v


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
def test_sizes_offsets_and_enum_values_from_c(tmp_path):
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "smoe.h"', "int main(void) {"]
    for name, cls in L.STRUCTS.items():
        lines.append('printf("%s sizeof %%zu\\n", sizeof(%s));' % (name, name))
        for field, _ in cls._fields_:
            lines.append('printf("%s.%s %%zu\\n", offsetof(%s, %s));' % (name, field, name, field))
    for enum, consts in L.ENUMS.items():
        lines.append('printf("%s sizeof %%zu\\n", sizeof(%s));' % (enum, enum))
        for c in consts:
            lines.append('printf("%s %%d\\n", (int)%s);' % (c, c))
    lines += ["return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-std=c11", "-I", os.path.join(ROOT, "include"), str(src), "-o", str(exe)],
                   check=True)
    got = dict(line.rsplit(" ", 1) for line in
               subprocess.run([str(exe)], check=True, capture_output=True, text=True)
               .stdout.splitlines())
    for name, cls in L.STRUCTS.items():
        assert int(got["%s sizeof" % name]) == ctypes.sizeof(cls), name
        for field, _ in cls._fields_:
            assert int(got["%s.%s" % (name, field)]) == getattr(cls, field).offset, (name, field)
    for enum, consts in L.ENUMS.items():
        assert int(got["%s sizeof" % enum]) == ctypes.sizeof(L.c_enum), enum
        for c, v in consts.items():
            assert int(got[c]) == v, c


def test_library_functions_and_defaults():
    lib = L.lib()
    desc = lib.smoe_layer_desc_default()
    assert (desc.d, desc.n, desc.E, desc.K) == (0, 0, 0, 0)
    assert desc.activation == L.SMOE_ACT_SWIGLU and desc.routing == L.SMOE_ROUTING_TOPK_SOFTMAX
    assert desc.round_tile == 128 and desc.dtype == L.SMOE_DTYPE_BF16
    assert desc.backend == L.SMOE_BACKEND_AUTO
    for s in L.ENUMS["smoe_status"].values():
        assert L.status_string(s)
    # A rejected descriptor raises SmoeError with smoe_last_error().
    ptr = ctypes.c_void_p()
    with pytest.raises(L.SmoeError, match="desc.d = 0"):
        L.check(lib.smoe_layer_create(ctypes.byref(desc), ctypes.byref(ptr)))


def test_route_cpu_binding():
    np = pytest.importorskip("numpy")  # a plain-array use of the ctypes layer, no torch
    lib = L.lib()
    desc = lib.smoe_layer_desc_default()
    desc.d, desc.n, desc.E, desc.K = 4, 4, 5, 2
    T = 3
    logits = np.array([[0, 3, 1, 2, -1], [5, 4, 3, 2, 1], [0, 0, 9, 0, 8]], dtype=np.float32)
    expert = np.zeros((T, 2), dtype=np.int32)
    score = np.zeros((T, 2), dtype=np.float32)
    res = L.smoe_routing_result()
    res.expert = expert.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    res.score = score.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    L.check(lib.smoe_route_cpu(ctypes.byref(desc), T,
                               logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                               ctypes.byref(res)))
    assert expert.tolist() == [[1, 3], [0, 1], [2, 4]]
    e = np.exp(np.array([3.0, 2.0]) - 3.0)
    np.testing.assert_allclose(score[0], e / e.sum(), rtol=1e-6)


def test_raw_argument_structs_match_the_mirrors():
    # smoe.functional fills forward_args_raw / backward_args_raw (pointers
    # as c_void_p, smoe_grad members flattened): every field at the offset
    # and with the size of the mirror's field, and the same total size.
    for raw, mirror in ((L.forward_args_raw, L.smoe_forward_args),
                        (L.backward_args_raw, L.smoe_backward_args)):
        want = {}
        for name, ctype in mirror._fields_:
            base = getattr(mirror, name).offset
            if ctype is L.smoe_grad:
                for f, t in L.smoe_grad._fields_:
                    want[name + "_" + f] = (base + getattr(L.smoe_grad, f).offset,
                                            ctypes.sizeof(t))
            else:
                want[name] = (base, ctypes.sizeof(ctype))
        got = {f: (getattr(raw, f).offset, getattr(raw, f).size) for f, _ in raw._fields_}
        assert got == want, raw.__name__
        assert [f for f, _ in raw._fields_] == list(want), raw.__name__
        assert ctypes.sizeof(raw) == ctypes.sizeof(mirror), raw.__name__
    L.lib()
    assert L.forward_raw.argtypes[1]._type_ is L.forward_args_raw
    assert L.backward_raw.argtypes[1]._type_ is L.backward_args_raw


@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (1, 1, False), (8, 3, True)])
def test_route_cpu_biased_matches_hf_deepseek_v3(n_group, topk_group, norm):
    # SIGMOID_TOPK against transformers' DeepseekV3TopkRouter on the same
    # fp32 logits: the same experts per token (HF's order is unspecified:
    # compared as sets) and the same weights (HF in fp32, smoe in double
    # rounded to fp32).
    torch = pytest.importorskip("torch")
    ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config
    T, d, E, K, scale = 64, 16, 32, 4, 2.5
    cfg = DeepseekV3Config(hidden_size=d, n_routed_experts=E, num_experts_per_tok=K,
                           n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                           routed_scaling_factor=scale)
    torch.manual_seed(5)
    router = ds.DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.uniform_(-0.3, 0.3)
        x = torch.randn(T, d)
        logits, weights, idx = router(x)
    lib = L.lib()
    desc = lib.smoe_layer_desc_default()
    desc.d, desc.n, desc.E, desc.K = d, 8, E, K
    desc.routing = L.SMOE_ROUTING_SIGMOID_TOPK
    desc.n_group, desc.topk_group = n_group, topk_group
    desc.renormalize = int(norm)
    desc.routed_scaling = scale
    lg = logits.float().contiguous()
    bias = router.e_score_correction_bias.float().contiguous()
    expert = torch.zeros(T, K, dtype=torch.int32)
    score = torch.zeros(T, K, dtype=torch.float32)
    res = L.smoe_routing_result()
    fp = ctypes.POINTER(ctypes.c_float)
    res.expert = ctypes.cast(expert.data_ptr(), ctypes.POINTER(ctypes.c_int32))
    res.score = ctypes.cast(score.data_ptr(), fp)
    L.check(lib.smoe_route_cpu_biased(ctypes.byref(desc), T, ctypes.cast(lg.data_ptr(), fp),
                                      ctypes.cast(bias.data_ptr(), fp), ctypes.byref(res)))
    hf_idx, order = idx.long().sort(dim=-1)
    hf_w = weights.gather(1, order)
    my_idx, my_order = expert.long().sort(dim=-1)
    my_w = score.gather(1, my_order)
    assert torch.equal(hf_idx, my_idx)
    assert torch.allclose(hf_w, my_w, rtol=1e-5, atol=1e-6)
