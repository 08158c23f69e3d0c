"""eval/probe_block_k.py's promotion rule, on fake timings (the GPU run is in eval/results/):
a candidate is promoted only when its bits equal the table's, its summed time over the
bucket's row counts is <= 0.97x the table's and no row count is over 1.02x; the file it
writes is what ``_linear_tiles.load_wide_k`` reads."""
import dataclasses
import json

import eval.probe_block_k as P
from areal_tik.unified_kernels import _linear_tiles as T

TABLE = T._cfg(16, 16, 4, 2, block_k=16)
FAST, FASTER_BUT_CAPPED, DIFFERENT_BITS = (T._cfg(16, 32, 4, 2, block_k=32), T._cfg(16, 16, 4, 3, block_k=32),
                                           T._cfg(16, 32, 4, 3, block_k=64))


def _run(monkeypatch, times, buckets=((64, (1, 64)),)):
    """probe_time over one fake shape with ``times[config][rows]`` (us) as the measurements."""
    monkeypatch.setattr(P, "SHAPES", (("tiny", "o", 256, 32),))
    monkeypatch.setattr(P, "EXTRA_SHAPES", ())
    monkeypatch.setattr(P, "TIMED_BUCKETS", buckets)
    monkeypatch.setattr(P, "timing_configs", lambda k, bucket=64: [FAST, FASTER_BUT_CAPPED, DIFFERENT_BITS])
    monkeypatch.setattr(P, "same_bits", lambda cfg, table, k, n: cfg != DIFFERENT_BITS)
    monkeypatch.setattr(P.L, "linear_config", lambda m, n, k, dtype: TABLE)
    current = {}

    def forward(x, w, bias, cfg):
        current["cfg"] = cfg
    monkeypatch.setattr(P.L, "linear_forward", forward)

    def measure(make_fn, m, k, n, rep_ms, timer):
        try:
            make_fn(None, None)()  # records which config this call times ...
        except TypeError:  # ... cuBLAS (F.linear of no tensors) records none
            pass
        cfg = current.pop("cfg", "cublas")
        return {"us": times.get(cfg, {}).get(m, 10.0)}
    monkeypatch.setattr(P, "measure", measure)
    return P.probe_time(False, 1)


def test_promotes_the_fastest_bit_equal_candidate_within_the_cap(monkeypatch, tmp_path):
    times = {TABLE: {1: 10.0, 64: 10.0}, FAST: {1: 9.5, 64: 9.0},  # 0.925x the table: promoted
             FASTER_BUT_CAPPED: {1: 10.3, 64: 6.0},  # least sum, but 1.03x at 1 row: over the cap
             DIFFERENT_BITS: {1: 1.0, 64: 1.0}}  # fastest, other bits: never timed nor promoted
    rows, promoted = _run(monkeypatch, times)
    assert promoted == {}  # the least-time candidate breaks the cap, so nothing is promoted
    times[FASTER_BUT_CAPPED] = {1: 10.1, 64: 6.0}  # 1.01x at 1 row: within the cap
    rows, promoted = _run(monkeypatch, times)
    assert promoted == {"64,32,256": dataclasses.asdict(FASTER_BUT_CAPPED)}
    assert [r for r in rows if r["config"] == P.name(DIFFERENT_BITS)] == [
        {"probe": "linear_time", "model": "tiny", "layer": "o", "K": 256, "N": 32, "bucket": 64,
         "config": P.name(DIFFERENT_BITS), "tag": "wide", "equal": 0}]
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"linear": promoted, "logprob": {}}))
    monkeypatch.setattr(T, "_WIDE_K_BF16", {})
    try:  # the file the probe writes is what the table loads
        monkeypatch.setenv("AREAL_TIK_LINEAR_TILES", str(path))
        assert T.load_wide_k(T.measured_overrides("linear")) == 1
        assert T._WIDE_K_BF16[(64, 32, 256)] == FASTER_BUT_CAPPED
    finally:
        T._select.cache_clear()


def test_keeps_the_table_below_the_gain_and_per_bucket(monkeypatch):
    times = {TABLE: {1: 10.0, 64: 10.0, 128: 10.0}, FAST: {1: 9.8, 64: 9.8, 128: 9.0},  # 0.98x: kept
             FASTER_BUT_CAPPED: {1: 11.0, 64: 11.0, 128: 12.0}}
    _, promoted = _run(monkeypatch, times, buckets=((64, (1, 64)), (128, (128,))))
    assert promoted == {"128,32,256": dataclasses.asdict(FAST)}  # 0.90x in the 128-row bucket only
