"""eval/bench_rollout.py's "compiled" backend: the standard set with its elementwise ops under
torch.compile computes what the standard set computes (a baseline, so bf16 rounding apart; the
KV store, a copy, exactly, slot -1 skipped) and leaves the shared standard set alone."""
import torch

from areal_tik.model import ops as standard_module
from areal_tik.model.ops import get_ops
from eval.bench_rollout import COMPILED_OPS, compiled_standard_ops


def test_compiled_standard_ops_compute_what_the_standard_ops_compute():
    eager, compiled = get_ops("standard"), compiled_standard_ops()
    assert compiled.kind == "standard"
    for name in COMPILED_OPS:  # compiled here, the plain function in every other standard set
        plain = getattr(standard_module, f"_std_{name}")
        assert getattr(compiled, name) is not plain and getattr(get_ops("standard"), name) is plain
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    res = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)

    def close(a, b):
        return torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)

    assert close(compiled.rms_norm(x, w, 1e-6), eager.rms_norm(x, w, 1e-6))
    for a, b in zip(compiled.add_rms_norm(x, res, w, 1e-6), eager.add_rms_norm(x, res, w, 1e-6)):
        assert close(a, b)
    gate_up = torch.randn(6, 128, generator=g).to(torch.bfloat16)
    assert close(compiled.silu_mul(gate_up), eager.silu_mul(gate_up))
    cos, sin = eager.rope_cos_sin(32, 16, 10000.0)
    q = torch.randn(6, 4, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(6, 2, 16, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 3, 5, 7, 30, 31])
    for a, b in zip(compiled.apply_rope(q, k, pos, cos, sin), eager.apply_rope(q, k, pos, cos, sin)):
        assert close(a, b)
    caches = [torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.tensor([5, -1, 0, 11, -1, 2])
    compiled.store_kv_cache(k, k.flip(-1), caches[0], caches[1], slots)
    eager.store_kv_cache(k, k.flip(-1), caches[2], caches[3], slots)
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert caches[0].view(12, 2, 16)[[5, 0, 11, 2]].abs().sum() > 0  # the rows landed
