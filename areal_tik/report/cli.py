"""``areal-tik report RUN_DIR [RUN_DIR ...] --out DIR``: the comparison of tik and stock
runs of the same recipes, from their run files: ``DIR/index.html`` (summary table, PNG
plots, audits) and ``DIR/summary.json``. ``--latest`` over folders of several sessions keeps
the newest pair of each recipe and names the recipes with none. With ``--wandb-entity/--wandb-project`` and the
``wandb-workspaces`` package, also a W&B Report (needs network; optional)."""
from __future__ import annotations

import json
from pathlib import Path

from .page import fmt, write_page
from .runs import every_comparable_pair, latest_pairs, load_runs, pair_runs, summary_table


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+", help="run folders (with run.json) or folders of them")
    parser.add_argument("--out", default="report", help="folder for index.html, the PNGs and summary.json")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the steady state")
    parser.add_argument("--latest", action="store_true",
                        help="folders of several sessions' results: keep the newest pair of each recipe (by the "
                             "tik run's date), leave out older pairs and runs without a partner (listed), and "
                             "name the end-to-end recipes with no pair")
    parser.add_argument("--wandb-entity", default=None)
    parser.add_argument("--wandb-project", default=None, help="also publish a W&B Report (online only)")


def main(args) -> int:
    if isinstance(args.warmup, bool) or args.warmup < 0:
        raise ValueError(f"--warmup must be an int >= 0, got {args.warmup!r}")
    runs, left_out, replicates = load_runs(args.runs), [], None
    if args.latest:
        replicates = every_comparable_pair(runs)  # the reward's replicates, superseded pairs included
        runs, left_out = latest_pairs(runs)
        for line in left_out:
            print(f"left out: {line}")
    pairs = pair_runs(runs)
    rows, means = summary_table(pairs, args.warmup, catalogue=args.latest, replicates=replicates)
    if args.latest:
        means["left_out"] = left_out
    out = Path(args.out)
    page = write_page(out, pairs, rows, means, args.warmup)
    (out / "summary.json").write_text(json.dumps({"rows": rows, "means": means}, indent=1))
    for r in rows:
        print(f"{r['recipe']}: throughput {fmt(r['throughput_whole'])} whole, {fmt(r['throughput_steady'])} "
              f"steady, {fmt(r['throughput_process'])} whole process; reward ratio {fmt(r['reward_ratio_mean'])} "
              f"+/- {fmt(r['reward_ratio_spread'], '')} (of the mean rewards {fmt(r['reward_ratio_of_means'])} "
              f"+/- {fmt(r['reward_ratio_of_means_se'], '')} s.e. paired by step, "
              f"{fmt(r['reward_ratio_of_means_se_unpaired'], '')} unpaired); "
              f"audit: {r['audit']}; stock path: {r['stock_decode']}")
    print(f"mean over {len(rows)}: throughput {fmt(means['throughput_whole'])} whole, "
          f"{fmt(means['throughput_steady'])} steady, {fmt(means['throughput_process'])} whole process "
          f"(over {means['throughput_process_configurations']}) (paper 1.10x); reward ratio "
          f"{fmt(means['reward_ratio_mean'])}, over the {means['reward_ratio_real_configurations']} with real "
          f"weights {fmt(means['reward_ratio_mean_real'])}, the ratios of mean rewards of "
          f"{means['reward_ratio_of_means_real_pooled_configurations']} of them pooled "
          f"{fmt(means['reward_ratio_of_means_real_pooled'])} +/- {fmt(means['reward_ratio_of_means_real_pooled_se'], '')} "
          f"(paper 1.00x)")
    if "reward_ratio_of_means_real_replicates" in means:
        print(f"reward ratio of mean rewards over every comparable real-weight pair, superseded ones included: "
              f"{means['reward_ratio_of_means_real_replicates_configurations']} pooled "
              f"{fmt(means['reward_ratio_of_means_real_replicates'])} +/- "
              f"{fmt(means['reward_ratio_of_means_real_replicates_se'], '')}")
    if len(means["stock_decode_paths"]) > 1:
        print(f"note: these means mix stock paths ({', '.join(means['stock_decode_paths'])})")
    if len(means["gpus"]) > 1:
        print(f"note: these means mix GPUs ({', '.join(means['gpus'])})")
    if means.get("recipes_without_pair"):
        print(f"no pair of: {', '.join(means['recipes_without_pair'])}")
    print(f"wrote {page}")
    if args.wandb_project:
        from .wandb_report import publish

        print(f"W&B report: {publish(pairs, args.wandb_entity, args.wandb_project)}")
    return 0
