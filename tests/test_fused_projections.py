"""Rollout's fused q/k/v and gate/up GEMMs: same bits as the training path's separate
linears, the same Parameter objects after the layout, a fallback when the weights are
no longer adjacent (model/fused.py)."""
import pytest
import torch

from areal_tik.model import UnifiedCausalLM, fuse_projection_storage
from areal_tik.model import fused
from areal_tik.model.fused import FusedProjections, SeparateProjections, adjacent_rows
from areal_tik.model.ops import get_ops

from ._bits import assert_bitwise
from ._model_utils import make_seqs, pack, tiny_hf


class _CountingOps:
    """The unified ops, counting linear launches (to see which path ran)."""

    def __init__(self):
        self.ops, self.linears = get_ops("unified"), []

    def linear(self, x, w, b=None, **kw):
        self.linears.append(tuple(w.shape))
        return self.ops.linear(x, w, b, **kw)

    def __getattr__(self, name):
        return getattr(self.ops, name)


def _layer(family):
    hf = tiny_hf(family, tied=False, fresh=True)
    fuse_projection_storage(hf)
    return hf, hf.model.layers[0]


def test_layout_keeps_parameters_values_and_is_idempotent():
    hf = tiny_hf("qwen2", tied=False, fresh=True)  # q/k/v with biases
    before = {name: (p, p.detach().clone()) for name, p in hf.named_parameters()}
    groups = fuse_projection_storage(hf)
    assert groups == 2 * hf.config.num_hidden_layers
    for name, p in hf.named_parameters():
        assert p is before[name][0], name
        assert_bitwise(p.detach(), before[name][1], name)
    attn = hf.model.layers[1].self_attn
    for what in ("weight", "bias"):
        parts = [getattr(m, what) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        view = adjacent_rows(parts)
        assert view is not None and view.shape[0] == sum(t.shape[0] for t in parts)
        assert_bitwise(view, torch.cat([t.detach() for t in parts]), what)
    ptrs = [p.data_ptr() for p in hf.parameters()]
    assert fuse_projection_storage(hf) == groups
    assert [p.data_ptr() for p in hf.parameters()] == ptrs  # no second copy


def test_in_place_updates_reach_the_fused_view():
    hf, layer = _layer("llama")
    mlp = layer.mlp
    opt = torch.optim.SGD(hf.parameters(), lr=0.5)  # an optimizer made before or after: same objects
    for p in hf.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    view = adjacent_rows([mlp.gate_proj.weight, mlp.up_proj.weight])
    assert view is not None
    assert_bitwise(view, torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]), "gate|up")


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_fused_projections_equal_separate_bitwise(family):
    hf, layer = _layer(family)
    x = torch.randn(7, hf.config.hidden_size).to(torch.bfloat16)
    counting = _CountingOps()
    with torch.inference_mode():
        fused_qkv = FusedProjections.qkv(counting, layer.self_attn, x)
        fused_gu = FusedProjections.gate_up(counting, layer.mlp, x)
        assert len(counting.linears) == 2, counting.linears
        sep_qkv = SeparateProjections.qkv(counting, layer.self_attn, x)
        sep_gu = SeparateProjections.gate_up(counting, layer.mlp, x)
    assert len(counting.linears) == 2 + 5
    for name, a, b in zip("qkv", fused_qkv, sep_qkv):
        assert_bitwise(a, b, name)
    assert_bitwise(fused_gu, sep_gu, "gate|up")


def test_not_adjacent_falls_back_to_separate_and_says_so(monkeypatch):
    hf, layer = _layer("qwen3")
    attn = layer.self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())  # a new storage
    x = torch.randn(3, hf.config.hidden_size).to(torch.bfloat16)
    counting = _CountingOps()
    monkeypatch.setattr(fused, "_warned_not_adjacent", False)
    with torch.inference_mode(), pytest.warns(UserWarning, match="qkv weights are not adjacent"):
        out = FusedProjections.qkv(counting, attn, x)
        ref = SeparateProjections.qkv(get_ops("unified"), attn, x)
    assert len(counting.linears) == 3  # the fallback, not a stale view of the old k
    for name, a, b in zip("qkv", out, ref):
        assert_bitwise(a, b, name)


def test_a_forward_autograd_records_runs_separate_and_grads_reach_each_weight():
    hf, layer = _layer("llama")
    attn = layer.self_attn
    x = torch.randn(3, hf.config.hidden_size).to(torch.bfloat16)
    counting = _CountingOps()
    q, k, v = FusedProjections.qkv(counting, attn, x)  # grad mode on, weights require grad
    assert len(counting.linears) == 3
    (q.float().sum() + k.float().sum() + v.float().sum()).backward()
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert m.weight.grad is not None and m.weight.grad.abs().sum() > 0


def test_a_partial_layout_is_said():
    hf = tiny_hf("llama", tied=False, fresh=True)
    hf.model.layers[1].mlp.up_proj.weight.data = hf.model.layers[1].mlp.up_proj.weight.data.float()
    model = UnifiedCausalLM.from_hf(hf, kernels="unified")
    layers = hf.config.num_hidden_layers
    with pytest.warns(UserWarning, match=f"{2 * layers - 1} of {2 * layers} q\\|k\\|v and gate\\|up groups"):
        assert model.fuse_projections() == 2 * layers - 1


def test_switch_off_runs_separate(monkeypatch):
    hf, layer = _layer("llama")
    monkeypatch.setattr(fused, "ENABLED", False)
    counting = _CountingOps()
    with torch.inference_mode():
        FusedProjections.qkv(counting, layer.self_attn, torch.randn(2, hf.config.hidden_size).to(torch.bfloat16))
    assert len(counting.linears) == 3


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_rollout_prefill_fused_equals_training_forward(family):
    hf = tiny_hf(family, tied=False, fresh=True)
    fuse_projection_storage(hf)
    model = UnifiedCausalLM.from_hf(hf, kernels="unified")
    seqs = make_seqs([5, 9], hf.config.vocab_size, seed=3)
    ids, pos, cu, max_len = pack(seqs, "cpu")
    counting = _CountingOps()
    model.ops = counting
    with torch.no_grad():
        train = model.forward_packed(ids, pos, cu, max_len)
        n_train = len(counting.linears)
        cache = model.new_kv_cache(num_blocks=4, block_size=16)
        rows = cu[1:].long() - 1
        roll = model.prefill(ids, pos, cu, max_len, cache, torch.arange(ids.numel()), rows)
    layers = hf.config.num_hidden_layers
    assert n_train == 7 * layers and len(counting.linears) - n_train == 4 * layers
    assert_bitwise(roll, train[rows], "last rows: fused rollout vs separate training")


# (hidden, q rows, kv rows, intermediate, bias) of Qwen3-0.6B, Qwen3-1.7B, Llama-3.2-1B, Qwen2.5-1.5B
GPU_MODELS = [(1024, 2048, 1024, 3072, False), (2048, 2048, 1024, 6144, False), (2048, 2048, 512, 8192, False),
              (1536, 1536, 256, 8960, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,nq,nkv,inter,bias", GPU_MODELS)
def test_gpu_fused_columns_equal_separate_linears(hidden, nq, nkv, inter, bias):
    """The hypothesis fused.py rests on, where the tile configs really differ: column n of
    one GEMM over [Wq; Wk; Wv] (N = nq + 2 nkv) and over [Wgate; Wup] has the bits of the
    separate GEMMs (other N, other tile choice, tiled or persistent), at decode, chunk and
    training row counts."""
    from areal_tik.unified_kernels import linear

    g = torch.Generator(device="cuda").manual_seed(5)
    ws = [(torch.randn(n, hidden, device="cuda", generator=g) * hidden ** -0.5).to(torch.bfloat16)
          for n in (nq, nkv, nkv, inter, inter)]
    bs = [torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) if bias else None for n in (nq, nkv, nkv)]
    qkv_w, gu_w = torch.cat(ws[:3]), torch.cat(ws[3:])
    qkv_b = torch.cat(bs) if bias else None
    for m in (1, 7, 64, 200, 1024, 2048, 4096):
        x = torch.randn(m, hidden, device="cuda", generator=g).to(torch.bfloat16)
        fused_qkv = linear(x, qkv_w, qkv_b)
        sep = torch.cat([linear(x, w, b) for w, b in zip(ws[:3], bs)], dim=-1)
        assert_bitwise(fused_qkv, sep, f"q|k|v, {m} rows")
        assert_bitwise(linear(x, gu_w), torch.cat([linear(x, w) for w in ws[3:]], dim=-1), f"gate|up, {m} rows")


def test_engine_lays_out_the_projections_at_start():
    from areal_tik.engine import LLM, EngineConfig

    hf = tiny_hf("llama", tied=False, fresh=True)
    attn = hf.model.layers[0].self_attn
    qkv = lambda: [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]  # noqa: E731
    assert adjacent_rows(qkv()) is None  # HF allocates each weight on its own
    with LLM(UnifiedCausalLM.from_hf(hf, kernels="unified"), EngineConfig(max_num_seqs=2, max_model_len=64,
                                                                          kv_block_size=16)):
        assert adjacent_rows(qkv()) is not None
