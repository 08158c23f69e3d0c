"""``areal-tik generate``: generate tokens, text and log-probs with the rollout engine.

    areal-tik generate --model tiny-qwen3 --num-prompts 4 --max-new-tokens 16
    areal-tik generate --model smollm2 --prompt "What is 2+3?" --temperature 0.7

Writes one JSON record per prompt (ids, tokens, log-probs, weight versions, finish reason).
"""
from __future__ import annotations

import json
import sys

from . import model_args


def add_arguments(parser) -> None:
    model_args.add_arguments(parser)
    parser.add_argument("--out", help="write JSONL records here (default: stdout)")


def _record(i: int, out, tokenizer) -> dict:
    record = {"index": i, "prompt_ids": out.prompt_ids, "token_ids": out.token_ids,
              "logprobs": out.logprobs, "versions": out.versions,
              "finish_reason": out.finish_reason, "logprob_temperature": out.logprob_temperature,
              "logprobs_match_sampling": out.logprobs_match_sampling}
    if tokenizer is not None:
        record["text"] = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    return record


def validate(args) -> None:
    from .validate import validate as check_flags

    check_flags(args, "generate")


def main(args) -> int:
    model, tokenizer = model_args.setup(args)
    with model_args.build_engine(args, model) as llm:
        outputs = model_args.run_generation(args, llm)
    sink = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    try:
        for i, out in enumerate(outputs):
            sink.write(json.dumps(_record(i, out, tokenizer)) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    if args.out:
        print(f"wrote {len(outputs)} records to {args.out}", file=sys.stderr)
    return 0
