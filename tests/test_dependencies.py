"""The dependencies the suite needs are installed at the versions it was written for: a
missing AReaL (or a different release) fails CI here, instead of turning the AReaL tests
into skips."""
from __future__ import annotations

import importlib.metadata


def test_areal_1_0_4_is_installed():
    import areal  # noqa: F401  (a hard import: missing AReaL is a failure)

    assert importlib.metadata.version("areal") == "1.0.4"


def test_the_smollm2_gguf_and_its_reader_are_installed():
    import gguf  # noqa: F401

    from areal_tik.model import smollm2_path

    assert smollm2_path().is_file()


def test_no_test_skips_on_a_missing_module():
    from pathlib import Path

    here = Path(__file__).resolve().parent
    offenders = [p.name for p in here.glob("test_*.py")
                 if "importorskip(" in p.read_text(encoding="utf-8") and p.name != Path(__file__).name]
    assert not offenders, f"importorskip hides a missing dependency in {offenders}"
