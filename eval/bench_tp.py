"""Check and benchmark: tensor-parallel rollout (TP = 2) against TP = 1 and the training forward.

Usage (two GPUs of one host, repo root):
    torchrun --standalone --nproc-per-node 2 -m eval.bench_tp [--models Qwen3-1.7B Llama-3.2-1B]
        [--batch 32] [--new-tokens 128] [--k-groups 2] [--eager] [--out DIR]

Per model (random-initialised with its published config; rank 0's weights broadcast to
rank 1, so both hold the same bits):
1. rank 0 alone: the full model with ``k_groups`` on the TP = 1 engine (a warm-up
   generate, then the timed one), and the packed TP = 1 training forward
   (``consistency.packed_logprobs``, the same k_groups) over its outputs;
2. both ranks: the model sharded (``shard_model``) on the TP = 2 engine, warm-up, timed.
Rank 0 then reports: tokens equal TP = 2 vs TP = 1, the share of bit-identical
log-probs TP = 2 vs TP = 1 engine and TP = 2 vs the training forward (the target is
100%), and tokens/s of each engine with their ratio. Rows go to a CSV (``--out``).
Sampling at T = 1 over the full vocabulary with one seed per request, EOS ignored.
``--eager`` turns CUDA graphs off (their capture includes the NCCL all_gathers).
"""
from __future__ import annotations

import gc
import os
import random
import time

import torch
import torch.distributed as dist

from eval.harness import bench_parser, print_summary, run_info, write_csv

from areal_tik import consistency
from areal_tik.engine import LLM, EngineConfig, SamplingParams
from areal_tik.engine.tensor_parallel import init_tensor_parallel
from areal_tik.model import UnifiedCausalLM, published_config, random_model
from areal_tik.model.tensor_parallel import shard_model

PROMPT_LEN = 128
BLOCK = 64


def _config(args, size: int) -> EngineConfig:
    max_len = PROMPT_LEN + args.new_tokens
    blocks = args.batch * -(-max_len // BLOCK) + 1  # one size on every rank, nothing measured
    return EngineConfig(max_num_seqs=args.batch, max_model_len=max_len, kv_block_size=BLOCK,
                        num_kv_blocks=blocks, cuda_graphs=not args.eager, max_graph_batch_size=args.batch,
                        tensor_parallel_size=size, k_groups=args.k_groups)


def _requests(args, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(8, vocab) for _ in range(PROMPT_LEN)] for _ in range(args.batch)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=seed * 1000 + i)
              for i in range(args.batch)]
    return prompts, params


def _timed_generate(llm, args, vocab: int):
    prompts, params = _requests(args, vocab, seed=1)
    llm.generate(prompts[:4], [SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)] * 4)  # compile
    prompts, params = _requests(args, vocab, seed=2)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    return outputs, time.perf_counter() - start


def _bits_equal(a, b) -> tuple[int, int, int]:
    """(token ids equal, log-prob bits equal, tokens) over outputs ``a`` vs ``b``."""
    same_tok = same_bits = total = 0
    for x, y in zip(a, b, strict=True):
        total += len(x.token_ids)
        same_tok += sum(i == j for i, j in zip(x.token_ids, y.token_ids))
        xs = torch.tensor(x.logprobs, dtype=torch.float32).view(torch.int32)
        ys = torch.tensor(y.logprobs, dtype=torch.float32).view(torch.int32)
        same_bits += int((xs == ys).sum()) if xs.shape == ys.shape else 0
    return same_tok, same_bits, total


def bench_model(name: str, args, group, device) -> dict | None:
    hf = random_model(published_config(name), device=device, seed=0)
    with torch.no_grad():
        for tensor in hf.state_dict().values():
            dist.broadcast(tensor, 0, group=group.device_group)
    vocab = hf.config.vocab_size
    row = None
    if group.rank == 0:
        full = UnifiedCausalLM.from_hf(hf, k_groups=args.k_groups)
        with LLM(full, _config(args, 1)) as llm:
            single, single_s = _timed_generate(llm, args, vocab)
        reference = consistency.packed_logprobs(full, single, max_tokens_per_batch=8192)
        del llm, full
    gc.collect()
    torch.cuda.empty_cache()
    dist.barrier(group=group.control_group)  # rank 1 waits here while rank 0 runs TP = 1
    model = shard_model(UnifiedCausalLM.from_hf(hf, k_groups=args.k_groups), group.rank, group.size,
                        group.device_group)
    with LLM(model, _config(args, group.size), tensor_parallel=group) as llm:
        parallel, parallel_s = _timed_generate(llm, args, vocab)
    if group.rank == 0:
        same_tok, same_bits, total = _bits_equal(parallel, single)
        training = consistency.compare(parallel, reference)
        tokens = args.batch * args.new_tokens
        row = dict(model=name, tp=group.size, k_groups=args.k_groups, batch=args.batch, new_tokens=args.new_tokens,
                   cuda_graphs=not args.eager, tokens=total, tokens_equal=same_tok,
                   logprob_bits_equal_tp1_engine=same_bits, logprob_bits_equal_training=training.num_identical,
                   bitwise_rate_training=training.num_identical / max(training.num_tokens, 1),
                   tp1_tokens_per_s=tokens / single_s, tp_tokens_per_s=tokens / parallel_s,
                   speedup=single_s / parallel_s, **run_info())
    del llm, model, hf
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["Qwen3-1.7B", "Llama-3.2-1B"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k-groups", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    args = parser.parse_args(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    group = init_tensor_parallel(_config(args, int(os.environ.get("WORLD_SIZE", "2"))), device)
    rows = [bench_model(name, args, group, device) for name in args.models]
    if group.rank == 0:
        path = write_csv(rows, args.out, "bench_tp.csv")
        print_summary([f"{r['model']}: TP={r['tp']} k_groups={r['k_groups']}: tokens equal {r['tokens_equal']}/"
                       f"{r['tokens']}, log-prob bits equal to TP=1 engine {r['logprob_bits_equal_tp1_engine']}, "
                       f"to the training forward {r['logprob_bits_equal_training']} "
                       f"({100 * r['bitwise_rate_training']:.2f}%); tokens/s TP=1 {r['tp1_tokens_per_s']:.0f}, "
                       f"TP={r['tp']} {r['tp_tokens_per_s']:.0f} ({r['speedup']:.2f}x)" for r in rows], [path])
    dist.barrier(group=group.control_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
