"""Slow, obviously-right references for every unified op.

Each function has the same signature and rounding points as its unified kernel, but
computes in float64 (``compute=torch.float64``, the test oracle) or in the standard
torch way (``compute=None``: what Hugging Face / AReaL do today, the "standard path").
They define the semantics the kernels implement; the kernels only fix the order of the
reductions.
"""
from __future__ import annotations

import math

import torch


def _acc(t: torch.Tensor, compute):
    return t.to(compute) if compute is not None else t.float()


def linear(x, weight, bias=None, *, compute=torch.float64):
    """``x @ weight.T + bias``: accumulate in ``compute``, add bias, round once to x.dtype."""
    if compute is None:
        return torch.nn.functional.linear(x, weight, bias)
    out = _acc(x, compute) @ _acc(weight, compute).T
    if bias is not None:
        out = out + _acc(bias, compute)
    return out.to(x.dtype)


def rms_norm(x, weight, eps=1e-6, *, compute=torch.float64):
    """Hugging Face Llama/Qwen RMSNorm: ``w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``."""
    xc = _acc(x, compute if compute is not None else torch.float32)
    var = xc.pow(2).mean(-1, keepdim=True)
    normed = (xc * torch.rsqrt(var + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def add_rms_norm(x, residual, weight, eps=1e-6, *, compute=torch.float64):
    """Fused residual add then RMSNorm; the sum is rounded to x.dtype as HF does."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps, compute=compute), summed


def rope_inv_freq(head_dim, base=10000.0, scaling=None):
    """Inverse frequencies in float64; ``scaling`` may be a Llama-3 ``rope_scaling`` dict."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: 'default', 'llama3'")
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    orig = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(q, k, positions, cos, sin, *, compute=torch.float64):
    """Neox-style (rotate-half) rotary embedding; cos/sin are ``[max_pos, head_dim // 2]``."""
    def rot(x):
        half = x.shape[-1] // 2
        c = cos[positions.long()].to(compute)[:, None, :]
        s = sin[positions.long()].to(compute)[:, None, :]
        x1, x2 = x[..., :half].to(compute), x[..., half:].to(compute)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return rot(q), rot(k)


def silu_mul(gate_up, *, compute=torch.float64):
    """SwiGLU on a packed ``[..., 2I]`` input: ``silu(gate).to(dtype) * up`` as HF computes it."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    g = gate.to(compute)
    act = (g * torch.sigmoid(g)).to(gate_up.dtype)
    return (act.to(compute) * up.to(compute)).to(gate_up.dtype)


def lm_head_logits(hidden, weight, *, compute=torch.float64):
    """LM-head logits rounded to the weight dtype, as ``lm_head`` returns them."""
    return linear(hidden, weight, None, compute=compute)


def token_logprobs(hidden, weight, targets, temperature=1.0, return_entropy=False,
                   *, compute=torch.float64):
    """``log_softmax(logits.float() / T)[target]`` (and entropy) from materialised logits."""
    logits = lm_head_logits(hidden, weight, compute=compute)
    z = logits.to(compute if compute is not None else torch.float32) / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return lp.float()
    ent = -(logp.exp() * logp).sum(-1)
    return lp.float(), ent.float()


def attention(q, k, v, cu_seqlens, softmax_scale=None, *, compute=torch.float64):
    """Causal grouped-query attention over packed sequences, one sequence at a time.

    q ``[T, Hq, D]``, k/v ``[T, Hk, D]``, ``cu_seqlens`` ``[S + 1]``; rows past
    ``cu_seqlens[-1]`` are padding and come back as zeros.
    """
    T, hq, d = q.shape
    hk = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    out = torch.zeros(q.shape, dtype=compute, device=q.device)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        qs = q[s:e].to(compute).transpose(0, 1)  # [Hq, L, D]
        ks = k[s:e].to(compute).transpose(0, 1).repeat_interleave(hq // hk, 0)
        vs = v[s:e].to(compute).transpose(0, 1).repeat_interleave(hq // hk, 0)
        scores = (qs @ ks.transpose(1, 2)) * scale
        L = e - s
        mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out[s:e] = (torch.softmax(scores, -1) @ vs).transpose(0, 1)
    return out.to(q.dtype)
