"""The in-process rollout engine never turns an aborted generation into a sample: AReaL
treats "length" as a finished response, so an interrupted one must fail instead."""
from __future__ import annotations

import asyncio

import pytest
from areal.api import ModelRequest

from areal_tik.adapter.inference import EngineAbortedError, TikInferenceEngine

from .test_areal_server import make_llm
from .test_exactness import engine_config, gconfig


def test_an_aborted_generation_raises_instead_of_reading_as_length():
    llm = make_llm()
    engine = TikInferenceEngine(engine_config(), llm=llm)
    engine.initialize()

    async def interrupted():
        llm.pause()  # the request is queued but no step runs
        task = asyncio.create_task(engine.agenerate(ModelRequest(input_ids=[5, 9, 17], gconfig=gconfig())))
        await asyncio.sleep(0.2)
        llm.close()  # pending requests finish with reason "abort"
        with pytest.raises(EngineAbortedError, match="aborted this request"):
            await asyncio.wait_for(task, timeout=30)

    try:
        asyncio.run(interrupted())
    finally:
        engine.destroy()
        llm.close()


def test_a_finished_generation_keeps_its_reason():
    llm = make_llm()
    engine = TikInferenceEngine(engine_config(), llm=llm)
    engine.initialize()
    try:
        resp = asyncio.run(asyncio.wait_for(
            engine.agenerate(ModelRequest(input_ids=[5, 9, 17], gconfig=gconfig())), timeout=60))
        assert resp.stop_reason in ("length", "stop") and len(resp.output_tokens) >= 1
    finally:
        engine.destroy()
        llm.close()
