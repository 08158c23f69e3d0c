"""A long in-process rollout says that it is alive: one line every period while requests
are in flight (a slow prefill under the interpreter says nothing else), none when idle."""
from __future__ import annotations

import asyncio
import time

import pytest
from areal.api import ModelRequest

from areal_tik.adapter.heartbeat import RolloutHeartbeat
from areal_tik.adapter.inference import TikInferenceEngine

from .test_areal_server import make_llm
from .test_exactness import engine_config, gconfig


def test_lines_only_while_requests_are_in_flight():
    lines: list[str] = []
    beat = RolloutHeartbeat(lines.append, every=0.05)
    try:
        assert beat.line() is None
        with beat.track(), beat.track():
            time.sleep(0.3)
            assert beat.in_flight == 2
        assert beat.finished == 2 and beat.line() is None
        time.sleep(0.2)
        n = len(lines)
        time.sleep(0.2)
        assert len(lines) == n, "no line once idle"
        assert n >= 2 and lines[0].startswith("areal-tik rollout: 2 requests generating, 0 finished")
    finally:
        beat.close()
    with pytest.raises(ValueError, match="every must be > 0"):
        RolloutHeartbeat(lines.append, every=0)


def test_the_in_process_engine_reports_a_stalled_rollout():
    llm = make_llm()
    engine = TikInferenceEngine(engine_config(), llm=llm)
    engine.initialize()
    lines: list[str] = []
    engine.heartbeat.log, engine.heartbeat.every = lines.append, 0.05

    async def stalled():
        llm.pause()  # a step that takes long: nothing finishes
        task = asyncio.create_task(engine.agenerate(ModelRequest(input_ids=[5, 9, 17], gconfig=gconfig())))
        await asyncio.sleep(0.4)
        llm.resume()
        await asyncio.wait_for(task, timeout=60)

    try:
        asyncio.run(stalled())
        assert any("1 requests generating, 0 finished" in line for line in lines), lines
    finally:
        engine.destroy()
        llm.close()
