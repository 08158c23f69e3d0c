"""Check and benchmark: tensor-parallel rollout (TP = 2) against TP = 1 and the training forward.

Usage (two GPUs of one host, repo root):
    torchrun --standalone --nproc-per-node 2 -m eval.bench_tp [--models Qwen3-1.7B Llama-3.2-1B]
        [--batch 32] [--new-tokens 128] [--k-groups 2] [--eager] [--vocab-parallel] [--out DIR]

Per model (random-initialised with its published config; rank 0's weights broadcast to
rank 1, so both hold the same bits):
1. rank 0 alone: the full model on the TP = 1 engine with k_groups = 1 (the cost of the
   tree at TP = 1 is measured against it), then with ``k_groups`` (a warm-up generate,
   then the timed one, each), and the packed TP = 1 training forward
   (``consistency.packed_logprobs``, the same k_groups) over its outputs;
2. both ranks: the model sharded (``shard_model``) on the TP = 2 engine, warm-up, timed.
Rank 0 then reports: tokens equal TP = 2 vs TP = 1, the share of bit-identical
log-probs TP = 2 vs TP = 1 engine and TP = 2 vs the training forward (the target is
100%), and tokens/s of each engine with their ratio. Rows go to a CSV (``--out``).
Sampling at T = 1 over the full vocabulary with one seed per request, EOS ignored.
``--eager`` turns CUDA graphs off (their capture includes the NCCL all_gathers).
``--vocab-parallel`` also shards the embedding and LM head over the TP ranks (rows of
``bench_tp_vocab.csv``, with the bytes each rank saves).
Without GPUs (gloo, the Triton interpreter) ``--tiny`` runs the same steps on the tiny
test configs of each family, as a dry run of this script:
    TRITON_INTERPRET=1 torchrun --standalone --nproc-per-node 2 -m eval.bench_tp --tiny \
        --batch 2 --new-tokens 2 --out /tmp/bench_tp
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
from areal_tik.model import UnifiedCausalLM, published_config, random_model, tiny_config
from areal_tik.model.tensor_parallel import shard_model

PROMPT_LEN = 128
BLOCK = 64
TINY = {"Qwen3-1.7B": "qwen3", "Llama-3.2-1B": "llama"}  # --tiny: the family's tiny test config


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _config(args, size: int, k_groups: int | None = None) -> EngineConfig:
    max_len = args.prompt_len + args.new_tokens
    block = 16 if args.tiny else BLOCK
    blocks = args.batch * -(-max_len // block) + 1  # one size on every rank, nothing measured
    return EngineConfig(max_num_seqs=args.batch, max_model_len=max_len, kv_block_size=block,
                        num_kv_blocks=blocks, cuda_graphs=not args.eager, max_graph_batch_size=args.batch,
                        tensor_parallel_size=size, k_groups=args.k_groups if k_groups is None else k_groups,
                        vocab_parallel=args.vocab_parallel and size > 1)


def _requests(args, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(8, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=seed * 1000 + i)
              for i in range(args.batch)]
    return prompts, params


def _timed_generate(llm, args, vocab: int):
    prompts, params = _requests(args, vocab, seed=1)
    warm = prompts[:4]
    llm.generate(warm, SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True))  # compiles
    prompts, params = _requests(args, vocab, seed=2)
    _sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    _sync()
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
    config = tiny_config(TINY[name], num_hidden_layers=1) if args.tiny else published_config(name)
    hf = random_model(config, device=device, seed=0)
    with torch.no_grad():
        for tensor in hf.state_dict().values():
            dist.broadcast(tensor, 0, group=group.device_group)
    vocab = hf.config.vocab_size
    row = None
    if group.rank == 0:
        with LLM(UnifiedCausalLM.from_hf(hf), _config(args, 1, k_groups=1)) as llm:  # no tree: its cost
            _, plain_s = _timed_generate(llm, args, vocab)
        del llm
        full = UnifiedCausalLM.from_hf(hf, k_groups=args.k_groups)
        with LLM(full, _config(args, 1)) as llm:
            single, single_s = _timed_generate(llm, args, vocab)
        reference = consistency.packed_logprobs(full, single, max_tokens_per_batch=8192)
        del llm, full
    _free()
    dist.barrier(group=group.control_group)  # rank 1 waits here while rank 0 runs TP = 1
    model = shard_model(UnifiedCausalLM.from_hf(hf, k_groups=args.k_groups), group.rank, group.size,
                        group.device_group, vocab_parallel=args.vocab_parallel)
    with LLM(model, _config(args, group.size), tensor_parallel=group) as llm:
        parallel, parallel_s = _timed_generate(llm, args, vocab)
        saved = llm.vocab_parallel_stats["vocab_saved_bytes"]
    if group.rank == 0:
        same_tok, same_bits, total = _bits_equal(parallel, single)
        training = consistency.compare(parallel, reference)
        tokens = args.batch * args.new_tokens
        row = dict(model=f"tiny {TINY[name]}" if args.tiny else name, tp=group.size, k_groups=args.k_groups,
                   vocab_parallel=args.vocab_parallel, vocab_saved_bytes_rank0=saved,
                   batch=args.batch, new_tokens=args.new_tokens,
                   cuda_graphs=not args.eager, tokens=total, tokens_equal=same_tok,
                   logprob_bits_equal_tp1_engine=same_bits, logprob_bits_equal_training=training.num_identical,
                   bitwise_rate_training=training.num_identical / max(training.num_tokens, 1),
                   tp1_k1_tokens_per_s=tokens / plain_s, tree_cost_tp1=single_s / plain_s - 1,
                   tp1_tokens_per_s=tokens / single_s, tp_tokens_per_s=tokens / parallel_s,
                   speedup=single_s / parallel_s, **run_info())
    del llm, model, hf
    _free()
    return row


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["Qwen3-1.7B", "Llama-3.2-1B"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k-groups", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--vocab-parallel", action="store_true", help="shard the embedding and LM head too")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (a CPU dry run of this script)")
    args = parser.parse_args(argv)
    args.prompt_len = 5 if args.tiny else PROMPT_LEN
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    group = init_tensor_parallel(_config(args, int(os.environ.get("WORLD_SIZE", "2"))), device)
    rows = [bench_model(name, args, group, device) for name in args.models]
    if group.rank == 0:
        path = write_csv(rows, args.out, "bench_tp_vocab.csv" if args.vocab_parallel else "bench_tp.csv")
        print_summary([f"{r['model']}: TP={r['tp']} k_groups={r['k_groups']} vocab_parallel={r['vocab_parallel']} "
                       f"(rank 0 saves {r['vocab_saved_bytes_rank0'] / 2**20:.0f} MiB): tokens equal {r['tokens_equal']}/"
                       f"{r['tokens']}, log-prob bits equal to TP=1 engine {r['logprob_bits_equal_tp1_engine']}, "
                       f"to the training forward {r['logprob_bits_equal_training']} "
                       f"({100 * r['bitwise_rate_training']:.2f}%); tokens/s TP=1 {r['tp1_tokens_per_s']:.0f}, "
                       f"TP={r['tp']} {r['tp_tokens_per_s']:.0f} ({r['speedup']:.2f}x); the tree at TP=1 costs "
                       f"{100 * r['tree_cost_tp1']:+.1f}% (k_groups=1: {r['tp1_k1_tokens_per_s']:.0f} tok/s)"
                       for r in rows], [path])
    dist.barrier(group=group.control_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
