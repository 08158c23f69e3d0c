"""``areal-tik check``: are the rollout log-probs the training forward's, bit for bit?

    areal-tik check --model tiny-qwen3 --num-prompts 2 --max-new-tokens 8
    areal-tik check --model qwen3-0.6b --num-prompts 64 --max-new-tokens 256   # GPU

Generates with the engine, recomputes every sampled token's log-prob with the packed
training forward (in another packing order), compares the bits (``areal_tik.bitwise``)
and, when a token differs, names the first op whose row differs. Then reports the
device qualification verdict (``areal_tik.qualify``, cached per device key) that the
actor consults before it reuses log-probs. Exit status 1 on any differing token or a
failed qualification.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from . import model_args


def add_arguments(parser) -> None:
    model_args.add_arguments(parser)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="tokens per packed forward")
    parser.add_argument("--json", help="also write the report as JSON here")
    parser.add_argument("--strict", action="store_true",
                        help="kept for old scripts: check always exits 1 unless every token is bit-identical")
    parser.add_argument("--no-qualify", action="store_true",
                        help="skip the device qualification verdict (probe or cache read)")
    parser.set_defaults(ignore_eos=True)


def validate(args) -> None:
    from .validate import validate as check_flags

    check_flags(args, "check")


def main(args) -> int:
    from areal_tik import consistency
    from areal_tik.engine.progress import Progress

    model, _ = model_args.setup(args)
    with model_args.build_engine(args, model) as llm:
        outputs = model_args.run_generation(args, llm)
    order = list(range(len(outputs)))
    random.Random(args.seed).shuffle(order)  # a different packing order than the rollout batch
    with Progress(len(outputs), "packed forward", enabled=not args.no_progress, unit="seq") as bar:
        reference = consistency.packed_logprobs(model, outputs, args.micro_batch_tokens, order, progress=bar)
    result = consistency.compare(outputs, reference)
    report = {"model": args.model, "kernels": args.kernels, "device": args.device,
              "sequences": len(outputs), "tokens": result.num_tokens,
              "identical_tokens": result.num_identical, "fraction_identical": result.fraction_identical,
              "max_abs_delta": result.max_abs_delta}
    print(f"{result.num_identical}/{result.num_tokens} tokens bit-identical "
          f"({100 * result.fraction_identical:.2f}%), max |delta logp| = {result.max_abs_delta:.3g}")
    if result.first_mismatch is not None:
        request, token = result.first_mismatch
        div = consistency.first_divergence(model, outputs, request, token, args.kv_block_size)
        where = div.where or "the LM head / log-prob (every hidden op agreed)"
        print(f"first differing token: request {request}, token {token} (position {div.position}, "
              f"{div.regime}); first differing op: {where}, max |delta| = {div.max_abs_delta:.3g} "
              f"after {div.ops_compared} op outputs compared")
        report["first_divergence"] = vars(div)
    qualified = True
    if not args.no_qualify:
        from areal_tik.qualify import qualify

        verdict = qualify(model.device)
        print(verdict.message() + (" (cached verdict)" if verdict.cached else ""))
        report["qualification"] = {"passed": verdict.passed, "failing_ops": verdict.failing_ops,
                                   "message": verdict.message(), "key": verdict.key.id}
        qualified = verdict.passed
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if result.identical and qualified else 1
