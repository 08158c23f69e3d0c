"""The stock training step's parts for eval/bench_train.py: what an AReaL user runs.

Attention backends (one transformers attention function, ``stock_attention``, registered
under ``ATTN_NAME``; ``use_attention(name)`` picks the backend the next forward runs):
- ``flash_varlen``: torch's FlashAttention ``varlen_attn`` reading ``cu_seq_lens_q`` (no
  mask, no host synchronisation); on CPU the project's standard op (SDPA per sequence)
  stands in.
- ``cudnn``: torch SDPA restricted to the cuDNN backend, the packed rows scattered into a
  right-padded ``[B, H, max_len, D]`` batch (causal: a real row never sees a pad key), as a
  user of SDPA without varlen runs it.
- ``fa4``: flash-attn-4's CuTe ``flash_attn.cute.flash_attn_varlen_func`` (SM90 forward and
  backward), from the kernels site.
Log-prob paths: ``chunked`` (a ``torch.compile``'d chunked log_softmax + gather written
like AReaL 1.0.4's ``gather_logprobs``), ``areal`` (AReaL's own ``gather_logprobs``) and
``liger`` (Liger-Kernel's fused linear cross-entropy, negated).

The kernel baselines live in a site directory of their own (``$AREAL_TIK_KERNELS_SITE``);
``add_kernels_site`` appends it after the image's site-packages. A baseline that does not
import or run is named with its error; its number is never made up.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys

import torch

from areal_tik.model.ops import _flash_varlen, get_ops

ATTN_NAME = "bench_train_stock"
KERNELS_SITE_ENV = "AREAL_TIK_KERNELS_SITE"
AVAILABLE = "available"
ATTENTIONS = ("flash_varlen", "cudnn", "fa4")  # preference order: the first is the reference
LOGPROBS = ("chunked", "areal", "liger")


def why(exc: BaseException) -> str:
    """One line naming an exception: what a skipped cell prints."""
    return (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0][:200]


def add_kernels_site(environ=None) -> list[str]:
    """Append ``$AREAL_TIK_KERNELS_SITE`` and its CuTe DSL folder
    (``nvidia_cutlass_dsl/dsl_packages``: the DSL's .pth is not read from a --target site)
    to the END of ``sys.path``: the image's own torch, triton and transformers, found
    earlier on the path, are never shadowed. Returns the folders added (none if unset)."""
    site = (os.environ if environ is None else environ).get(KERNELS_SITE_ENV)
    if not site:
        return []
    added = []
    for folder in (site, os.path.join(site, "nvidia_cutlass_dsl", "dsl_packages")):
        if os.path.isdir(folder) and folder not in sys.path:
            sys.path.append(folder)
            added.append(folder)
    importlib.invalidate_caches()
    return added


# ------------------------------------------------------------------ attention


def load_fa4_varlen():
    from flash_attn.cute import flash_attn_varlen_func
    return flash_attn_varlen_func


def _flash_varlen_attention(q, k, v, cu, max_len, scaling):
    found = _flash_varlen() if q.is_cuda else None
    if found is None:  # CPU smoke runs: the project's standard op (SDPA per sequence)
        return get_ops("standard").attention_varlen(q, k, v, cu, max_len, scaling)
    varlen_attn, causal, has_gqa, has_scale = found
    extra = dict(causal, **({"scale": scaling} if has_scale else {}))
    if k.shape[1] != q.shape[1]:
        if has_gqa:
            extra["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)
    return out[0] if isinstance(out, tuple) else out


def pad_index(cu: torch.Tensor, total: int, max_len: int) -> torch.Tensor:
    """Row of each packed token in a right-padded ``[B * max_len]`` batch, on the device
    (no host read of ``cu``): sequence * max_len + position within it."""
    t = torch.arange(total, device=cu.device)
    cu = cu.long()
    seq = torch.searchsorted(cu[1:], t, right=True)
    return seq * max_len + (t - cu[seq])


CUDNN_GQA: dict[str, bool] = {}  # "native": whether cuDNN took enable_gqa (learned once)


def _cudnn_attention(q, k, v, cu, max_len, scaling):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    n, idx = cu.shape[0] - 1, pad_index(cu, q.shape[0], max_len)

    def pad(x):  # [T, H, D] -> [B, H, L, D], zeros in the padding (differentiable in x)
        out = x.new_zeros(n * max_len, *x.shape[1:]).index_copy(0, idx, x)
        return out.view(n, max_len, *x.shape[1:]).transpose(1, 2)

    qp, kp, vp = pad(q), pad(k), pad(v)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        if kp.shape[1] != qp.shape[1] and CUDNN_GQA.get("native", True):
            try:
                o = sdpa(qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=True)
                CUDNN_GQA["native"] = True
            except RuntimeError:  # this cuDNN path refuses GQA: repeat K/V from now on
                CUDNN_GQA["native"] = False
        if kp.shape[1] == qp.shape[1] or not CUDNN_GQA["native"]:
            group = qp.shape[1] // kp.shape[1]
            kp, vp = (t.repeat_interleave(group, dim=1) for t in (kp, vp))
            o = sdpa(qp, kp, vp, is_causal=True, scale=scaling)
    return o.transpose(1, 2).reshape(n * max_len, *q.shape[1:])[idx]


FA4_NOTES: list[str] = []  # a strided-input failure retried on contiguous copies, once


def _fa4_attention(q, k, v, cu, max_len, scaling):
    fn = load_fa4_varlen()
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
              softmax_scale=scaling, causal=True)
    if not FA4_NOTES:
        try:
            out = fn(q, k, v, **kw)
            return out[0] if isinstance(out, tuple) else out
        except Exception as exc:  # noqa: BLE001  (recorded, then the contiguous retry decides)
            FA4_NOTES.append(f"strided q/k/v refused ({why(exc)}): contiguous copies")
    out = fn(q.contiguous(), k.contiguous(), v.contiguous(), **kw)
    return out[0] if isinstance(out, tuple) else out


_BACKENDS = {"flash_varlen": _flash_varlen_attention, "cudnn": _cudnn_attention, "fa4": _fa4_attention}
_ACTIVE = {"attention": "flash_varlen"}


def use_attention(name: str) -> None:
    """Pick the backend ``stock_attention`` runs from the next forward on."""
    if name not in _BACKENDS:
        raise ValueError(f"attention backend must be one of {sorted(_BACKENDS)}, got {name!r}")
    _ACTIVE["attention"] = name


def stock_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention over packed rows: q/k/v ``[1, H, T, D]`` -> ``([1, T, Hq, D], None)``."""
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return _BACKENDS[_ACTIVE["attention"]](q, k, v, cu, max_len, scaling)[None], None


def attention_labels(device) -> dict[str, str]:
    cuda = torch.device(device).type == "cuda"
    found = _flash_varlen() if cuda else None
    flash = ("SDPA per sequence (no torch varlen_attn here)" if found is None else
             "torch FlashAttention varlen_attn" + ("" if found[2] else " (K/V heads repeated for GQA)"))
    return {"flash_varlen": flash, "cudnn": "torch SDPA cuDNN backend, padded to the longest sequence",
            "fa4": "flash-attn-4 (CuTe) flash_attn_varlen_func"}


def _probe_cudnn(device):
    """cuDNN SDPA switched on in this torch; whether a shape runs is found at run time
    (its error then names the cell), not from a toy shape here."""
    if not torch.backends.cudnn.is_available():
        raise RuntimeError("torch.backends.cudnn is not available")
    if not torch.backends.cuda.cudnn_sdp_enabled():
        raise RuntimeError("torch.backends.cuda.cudnn_sdp_enabled() is False")


# A causal GQA varlen forward + backward at a small shape (two sequences, 16 q / 8 kv heads,
# D = 128). Run in a child process: on the H200, flash-attn-4 4.0.0b19's SM90 backward raised
# cudaErrorIllegalInstruction, which is sticky and ended the whole benchmark process with it.
FA4_PROBE = """
import os, sys
site = os.environ.get("AREAL_TIK_KERNELS_SITE")
sys.path += [site, os.path.join(site, "nvidia_cutlass_dsl", "dsl_packages")] if site else []
from flash_attn.cute import flash_attn_varlen_func as fn  # before torch: an import error is quick
import torch
T, cu = 512, torch.tensor([0, 200, 512], device="cuda", dtype=torch.int32)
q = torch.randn(T, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
out = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=312, max_seqlen_k=312, causal=True)
(out[0] if isinstance(out, tuple) else out).float().sum().backward()
torch.cuda.synchronize()
assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), "non-finite gradient"
"""


def probe_fa4(timeout_s: float = 240.0) -> None:
    """flash-attn-4's forward and backward once, in a child process; raises with the child's
    last error line when it fails (an import error, a CUDA fault, a non-finite gradient)."""
    import subprocess

    try:  # the child appends the kernels site itself, as add_kernels_site does (after site-packages)
        done = subprocess.run([sys.executable, "-c", FA4_PROBE], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"flash-attn-4 probe (forward + backward) did not finish in {timeout_s:.0f} s")
    if done.returncode:
        lines = [line.strip() for line in (done.stderr or "").splitlines() if line.strip()]
        named = [line for line in lines if "Error" in line or "error" in line]
        raise RuntimeError(f"flash-attn-4 probe (forward + backward) failed: {(named or lines or ['?'])[-1][:160]}")


def attention_status(device) -> dict[str, str]:
    """backend -> "available" or why not (the exact import or probe error)."""
    out = {"flash_varlen": AVAILABLE}  # on CPU its stand-in runs, named by attention_labels
    for name, probe in (("cudnn", _probe_cudnn), ("fa4", lambda device: probe_fa4())):
        if torch.device(device).type != "cuda":
            out[name] = "needs a CUDA device"
            continue
        try:
            probe(device)
            out[name] = AVAILABLE
        except Exception as exc:  # noqa: BLE001  (any failure is the baseline's status)
            out[name] = why(exc)
    return out


# ------------------------------------------------------------------ log-prob


def _gather_chunk(logits, labels, temperature):
    log_probs = torch.nn.functional.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


_gather_chunk_compiled = torch.compile(_gather_chunk)


def chunked_gather_logprobs(logits, labels, temperature=1.0, chunk_size=1024):
    """AReaL 1.0.4's gather_logprobs re-stated: the compiled chunk function over 1024-row chunks."""
    return torch.cat([_gather_chunk_compiled(logits[i:i + chunk_size], labels[i:i + chunk_size], temperature)
                      for i in range(0, logits.shape[0], chunk_size)])


def _areal_gather():
    from areal.utils.functional import gather_logprobs
    return gather_logprobs


def _liger_loss():
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    return LigerFusedLinearCrossEntropyLoss(reduction="none")


def logprob_paths() -> dict[str, tuple]:
    """name -> (callable or None, label or the exact import error). ``chunked`` and
    ``areal`` take (logits, labels, T); ``liger`` is the loss module (weight, hidden, labels)."""
    out = {"chunked": (chunked_gather_logprobs, "torch.compile'd chunked log_softmax+gather as AReaL's")}
    for name, load, label in (
            ("areal", _areal_gather, "AReaL {} gather_logprobs (torch.compile, 1024-token chunks)"),
            ("liger", _liger_loss, "Liger-Kernel {} fused linear cross-entropy")):
        try:
            fn = load()
        except Exception as exc:  # noqa: BLE001  (a missing or broken install: named, skipped)
            out[name] = (None, why(exc))
            continue
        out[name] = (fn, label.format(_version("areal" if name == "areal" else "liger-kernel")))
    return out


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "(version unknown)"


# ------------------------------------------------------------------ which combinations


@dataclasses.dataclass
class Baselines:
    """The stock step's parts this run can use, in preference order, and the skipped ones."""
    attentions: list[str]
    logprobs: list[str]
    paths: dict  # logprob_paths(): name -> (callable or None, label or error)
    skipped: dict[str, str]  # "attention:<name>" / "logprob:<name>" -> why


def select_baselines(attention: dict[str, str], paths: dict) -> Baselines:
    """Split attention_status() and logprob_paths() into what runs and what is skipped."""
    skipped = {f"attention:{n}": st for n, st in attention.items() if st != AVAILABLE}
    skipped.update({f"logprob:{n}": label for n, (fn, label) in paths.items() if fn is None})
    return Baselines([n for n in ATTENTIONS if attention.get(n) == AVAILABLE],
                     [n for n in LOGPROBS if n in paths and paths[n][0] is not None], paths, skipped)


def restrict(b: Baselines, keep_a, keep_p) -> Baselines:
    """Only the backends and paths named by --attention / --logprob (the rest: skipped)."""
    skipped = dict(b.skipped)
    skipped.update({f"attention:{n}": "not asked for (--attention)" for n in b.attentions if n not in keep_a})
    skipped.update({f"logprob:{n}": "not asked for (--logprob)" for n in b.logprobs if n not in keep_p})
    return Baselines([n for n in b.attentions if n in keep_a], [n for n in b.logprobs if n in keep_p],
                     b.paths, skipped)


Combo = tuple[str, str]  # (attention backend, log-prob path)


def fastest(times: dict[Combo, float | None]) -> tuple[Combo, float] | None:
    """The fastest combination that ran (None or NaN: it failed), or None if none ran."""
    ran = [(ms, combo) for combo, ms in times.items() if ms is not None and not math.isnan(ms)]
    return (min(ran)[1], min(ran)[0]) if ran else None


def rounds(attentions, logprobs, times: dict[Combo, float | None]):
    """The combinations to time, round by round (each read after the last one's ``times``
    are in): every attention backend with the reference log-prob, every log-prob path with
    the fastest backend, every backend with the fastest path. Not the full cross product."""
    yield first_round(attentions, logprobs)
    yield second_round(attentions, logprobs, times)
    yield third_round(attentions, logprobs, times)


def first_round(attentions, logprobs) -> list[Combo]:
    """Every available attention backend with the reference log-prob (the first available)."""
    return [(a, logprobs[0]) for a in attentions] if logprobs else []


def second_round(attentions, logprobs, times: dict[Combo, float | None]) -> list[Combo]:
    """Every other log-prob path with the fastest attention of the first round (the
    reference backend if none ran): not the full cross product, which costs a step each."""
    if not attentions:
        return []
    best = fastest({c: t for c, t in times.items() if c[1] == logprobs[0]}) if logprobs else None
    attention = best[0][0] if best else attentions[0]
    return [(attention, p) for p in logprobs if (attention, p) not in times]


def third_round(attentions, logprobs, times: dict[Combo, float | None]) -> list[Combo]:
    """Every attention backend with the fastest log-prob path found so far, where that is
    not the reference one (then the first round already timed them)."""
    best = fastest(times)
    if best is None:
        return []
    path = best[0][1]
    return [(a, path) for a in attentions if (a, path) not in times]


SUSPECT_FLOOR = 0.25  # nats: bf16 backends differ from ours by 0.04-0.17 (H200, 6ae65d4)


def suspect(diff: float, reference: float | None) -> bool:
    """A stock combination whose log-probs differ from ours by more than 4x what the
    reference combination's do (and more than SUSPECT_FLOOR) computes something else (a
    mask or layout error): its time is reported but not counted as "fastest stock"."""
    return not diff <= max(4 * reference if reference is not None else 0.0, SUSPECT_FLOOR)


# ------------------------------------------------------------------ report


def fmt_path(m: dict) -> str:
    """One path's measurement (bench_train.measure + MFU) as printed, or its error."""
    if "median_ms" not in m:
        return f"ERROR {m.get('error', 'no time')}"
    peak = f", peak {m['peak_gib']:.1f} GiB" if "peak_gib" in m else ""
    warm = f"warm-up {m['warmup_ms']:.0f} ms ({m['warmup_compiles']} JIT compiles), " if "warmup_ms" in m else ""
    return (f"{m['median_ms']:.1f} ms ({warm}first {m['first_ms']:.0f} ms{peak}, MFU {100 * m['mfu']:.1f}%, "
            f"JIT compiles first/after {m['compiles_first']}/{m['compiles_after_first']}"
            + (f", max |lp - ours| {m['lp_max_abs_diff_vs_ours']:.3g}" if "lp_max_abs_diff_vs_ours" in m else "")
            + ")" + (f" NOT COUNTED: {m['error']}" if "error" in m else ""))


def headline(rows) -> None:
    """One line per case: fastest stock / ours (the target: >= 1.0x) and both MFUs."""
    cases = dict.fromkeys((r["model"], r["packing"]) for r in rows if "model" in r)
    for model, pack in cases:
        get = {(r["path"], r["metric"]): r["value"] for r in rows
               if r.get("model") == model and r.get("packing") == pack}
        best = get.get(("compare", "fastest_stock"))
        ratio = get.get(("compare", "fastest_stock_over_ours"))
        if best is None or ratio is None:
            print(f"headline {model} {pack}: no ratio (ours or every stock step failed)")
            continue
        print(f"headline {model} {pack}: fastest stock {best} {get[(best, 'median_ms')]:.1f} ms "
              f"(MFU {100 * get[(best, 'mfu')]:.1f}%) vs ours {get[('ours', 'median_ms')]:.1f} ms "
              f"(MFU {100 * get[('ours', 'mfu')]:.1f}%): fastest-stock/ours {ratio:.2f}x")
