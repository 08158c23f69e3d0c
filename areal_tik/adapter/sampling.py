"""AReaL's ``gconfig`` as the engine's ``SamplingParams``: the one translation, used by the
in-process engine, the client and the server.

- ``sampling_params(gconfig, max_new_tokens, vocab_size)``: the in-process engine's and
  the client's translation; ``ValueError`` for every option in ``UNSUPPORTED`` that is set
  (never silently ignored).
- ``to_json(params)`` / ``from_json(payload, vocab_size)``: the same parameters on the
  wire, SGLang's ``sampling_params`` names; the server refuses the ``UNSUPPORTED``
  options by the same names (clients other than ours may send them).

``top_k`` is "no filter" at 0, below 0 (SGLang's -1) or at any k >= the vocabulary
(AReaL's default is 1e8): ``top_k_active`` decides it in one place.
"""
from __future__ import annotations

# gconfig / SGLang options the areal-tik engine does not implement -> the value that means
# "off". One list for the in-process engine, the client and the server.
UNSUPPORTED = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "use_beam_search": False,
    "stop": None,  # stop strings (stop_token_ids are supported)
}
# SGLang text-side options that change no token id; accepted and ignored by the server.
TEXT_ONLY = ("skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens")
_WIRE = ("temperature", "top_k", "top_p", "max_new_tokens", "stop_token_ids", "ignore_eos", "seed")


def top_k_active(top_k: int, vocab_size: int | None) -> bool:
    """AReaL disables top-k with 0/negative or any k >= vocabulary size (default 1e8)."""
    if top_k <= 0:
        return False
    return vocab_size is None or top_k < vocab_size


def _is_off(name: str, value) -> bool:
    off = UNSUPPORTED[name]
    return value in (off, None) or (off is None and not value)


def unsupported_set(options: dict) -> list[str]:
    """Names of the ``UNSUPPORTED`` options that ``options`` turns on."""
    return [name for name in UNSUPPORTED if name in options and not _is_off(name, options[name])]


def sampling_params(gconfig, max_new_tokens: int, vocab_size: int | None):
    """``SamplingParams`` for an AReaL ``GenerationHyperparameters``; ValueError for the
    options the engine does not implement (rather than ignoring them)."""
    from areal_tik.engine import SamplingParams

    if gconfig.n_samples != 1:
        raise ValueError(f"one request samples one sequence; got n_samples={gconfig.n_samples}")
    bad = unsupported_set({name: getattr(gconfig, name, None) for name in UNSUPPORTED})
    if bad:
        raise ValueError(f"the areal-tik engine does not implement {bad}; unset them in gconfig "
                         "(stop_token_ids is supported)")
    top_k = int(gconfig.top_k)
    return SamplingParams(
        temperature=0.0 if gconfig.greedy else float(gconfig.temperature),
        top_k=top_k if top_k_active(top_k, vocab_size) else 0,
        top_p=float(gconfig.top_p),
        max_new_tokens=int(max_new_tokens),
        stop_token_ids=tuple(int(t) for t in gconfig.stop_token_ids if t is not None),
        ignore_eos=bool(gconfig.ignore_eos),
    )


def graph_temperature(gconfig, vocab_size: int | None = None) -> float | None:
    """The temperature a training run's engine should sample at inside its decode graphs
    (``EngineConfig.graph_sample_temperature``): the rollout's, when its requests can be
    drawn there (not greedy, no top-k / top-p); None otherwise, so that no graph draws
    tokens every step that the step then draws again eagerly."""
    t = 0.0 if gconfig.greedy else float(gconfig.temperature)
    filtered = top_k_active(int(gconfig.top_k), vocab_size) or float(gconfig.top_p) < 1.0
    return t if t > 0 and not filtered else None


def to_json(params) -> dict:
    """``params`` as an SGLang-style ``sampling_params`` object."""
    out = {name: getattr(params, name) for name in _WIRE}
    out["stop_token_ids"] = list(params.stop_token_ids)
    if out["seed"] is None:
        del out["seed"]
    return out


def from_json(payload, vocab_size: int):
    """``SamplingParams`` from an SGLang-style ``sampling_params`` dict; ValueError names
    the option or value that is not served."""
    from areal_tik.engine import SamplingParams

    if not isinstance(payload, dict):
        raise ValueError(f"sampling_params must be an object, got {type(payload).__name__}")
    bad = unsupported_set(payload)
    if bad:
        raise ValueError(f"sampling_params {bad} are not implemented by the areal-tik engine "
                         "(stop strings: use stop_token_ids)")
    unknown = sorted(set(payload) - set(_WIRE) - set(UNSUPPORTED) - set(TEXT_ONLY))
    if unknown:
        raise ValueError(f"unknown sampling_params {unknown}; served: {list(_WIRE)}")
    kwargs = {name: payload[name] for name in _WIRE if name in payload}
    top_k = kwargs.get("top_k", 0)
    if isinstance(top_k, int) and not isinstance(top_k, bool) and not top_k_active(top_k, vocab_size):
        kwargs["top_k"] = 0
    kwargs["stop_token_ids"] = tuple(kwargs.get("stop_token_ids") or ())
    return SamplingParams(**kwargs)
