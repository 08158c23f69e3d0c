"""Run files -> comparable (tik, stock) pairs -> the summary table.

Per recipe: the throughput ratio tik/stock of tokens per second (prompt + generated
tokens over wall step time), over the whole run and over the steady state (steps after
``warmup``), and over the whole process (all tokens over the process's seconds less
writing a missing checkpoint: start-up and teardown count; n/a for run files without
the timing); the reward ratio tik/stock per step, its mean and spread (population std)
over the steps where the stock reward is non-zero. Then the means over the recipes, next
to the paper's 1.10x throughput and 1.00x reward ratio.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

RUN_FILE = "run.json"
PAPER_THROUGHPUT, PAPER_REWARD = 1.10, 1.00
MODES = ("tik", "stock")


@dataclass(frozen=True)
class Pair:
    recipe: str
    tik: dict
    stock: dict


def find_run_files(paths) -> list[Path]:
    """Every run file at or under ``paths`` (run folders or folders of them)."""
    found = []
    for p in map(Path, paths):
        if p.is_file() and p.name == RUN_FILE:
            found.append(p)
        elif (p / RUN_FILE).is_file():
            found.append(p / RUN_FILE)
        elif p.is_dir():
            found += sorted(p.rglob(RUN_FILE))
        else:
            raise ValueError(f"{p}: not a run folder (no {RUN_FILE}) nor a folder of run folders")
    if not found:
        raise ValueError(f"no {RUN_FILE} under {[str(p) for p in paths]}")
    return found


def load_runs(paths) -> list[dict]:
    runs = []
    for path in find_run_files(paths):
        run = json.loads(path.read_text())
        if run.get("mode") not in MODES:
            raise ValueError(f"{path}: mode {run.get('mode')!r} is not one of {MODES}")
        runs.append({**run, "path": str(path.parent)})
    return runs


def _describe(run: dict) -> str:
    return f"{run['path']} (recipe {run['recipe']}, {run['mode']})"


def check_comparable(tik: dict, stock: dict) -> None:
    """ValueError naming the first difference that makes the two runs incomparable (for
    configs, the fields that differ when both run files keep the recipe as asked)."""
    for key, label in (("recipe", "recipe"), ("seeds", "seeds"), ("steps", "steps"),
                       ("config_digest", "config (digest of the recipe as asked)")):
        if tik[key] != stock[key]:
            detail = config_difference(tik, stock) if key == "config_digest" else ""
            raise ValueError(f"not a comparable pair: different {label}: tik {tik[key]!r} in {tik['path']} "
                             f"vs stock {stock[key]!r} in {stock['path']}{detail}")


def config_difference(tik: dict, stock: dict, limit: int = 12) -> str:
    """'; fields that differ: ...' from the run files' ``config_asked`` (a field in one run
    only: one run's code had it, the other's did not), or why they cannot be named."""
    fields = {mode: run.get("config_asked") or {} for mode, run in (("tik", tik), ("stock", stock))}
    missing = [mode for mode, f in fields.items() if not f]
    if missing:
        return (f"; no fields of the recipe as asked in the {' and '.join(missing)} run file "
                "(older run files keep none), so the fields that differ cannot be named")
    keys = sorted(set(fields["tik"]) | set(fields["stock"]))
    diffs = [f"{k} (tik {fields['tik'].get(k, '-')}, stock {fields['stock'].get(k, '-')})"
             for k in keys if fields["tik"].get(k) != fields["stock"].get(k)]
    more = f", and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return f"; fields that differ ('-': not in that run's config): {', '.join(diffs[:limit])}{more}"


def pair_runs(runs: list[dict]) -> list[Pair]:
    """One (tik, stock) pair per recipe; ValueError for a run without its partner, two
    runs of one mode and recipe, or a pair that is not comparable."""
    by_recipe: dict[str, dict[str, dict]] = {}
    for run in runs:
        modes = by_recipe.setdefault(run["recipe"], {})
        if run["mode"] in modes:
            raise ValueError(f"two {run['mode']} runs of recipe {run['recipe']}: {modes[run['mode']]['path']} "
                             f"and {run['path']}; pass one of each mode per recipe, or --latest")
        modes[run["mode"]] = run
    pairs = []
    for recipe, modes in by_recipe.items():
        missing = [m for m in MODES if m not in modes]
        if missing:
            (present,) = modes.values()
            others = [_describe(r) for r in runs if r["recipe"] != recipe and r["mode"] == missing[0]]
            raise ValueError(f"not a comparable pair: {_describe(present)} has no {missing[0]} run of the same "
                             f"recipe" + (f"; {missing[0]} runs given: {others}" if others else ""))
        check_comparable(modes["tik"], modes["stock"])
        pairs.append(Pair(recipe, modes["tik"], modes["stock"]))
    return sorted(pairs, key=lambda p: p.recipe)


def _folder_groups(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """Runs grouped by their recipe folder (the parent of the mode folder): mode -> run."""
    groups: dict[str, dict[str, dict]] = {}
    for run in runs:
        modes = groups.setdefault(str(Path(run["path"]).parent), {})
        if run["mode"] in modes:  # a mode folder holds one run file
            raise ValueError(f"two {run['mode']} runs under {Path(run['path']).parent}")
        modes[run["mode"]] = run
    return groups


def every_comparable_pair(runs: list[dict]) -> list[Pair]:
    """Every recipe folder holding a comparable (tik, stock) pair, superseded ones included:
    for a reward, each pair is one more replicate, even where ``latest_pairs`` keeps only the
    newest for throughput (whose code moves between sessions)."""
    pairs = []
    for _, modes in sorted(_folder_groups(runs).items()):
        if set(modes) != set(MODES):
            continue
        try:
            check_comparable(modes["tik"], modes["stock"])
        except ValueError:
            continue
        pairs.append(Pair(modes["tik"]["recipe"], modes["tik"], modes["stock"]))
    return pairs


def latest_pairs(runs: list[dict]) -> tuple[list[dict], list[str]]:
    """The newest pair of each recipe among run files of several sessions: (the runs kept,
    what was left out and why). Runs are grouped by their recipe folder (the parent of the
    mode folder, as ``areal-tik run --out`` writes them); a group with both modes is a pair,
    and of a recipe's comparable pairs the one whose tik run has the latest ``metadata.date``
    stays. A group with one mode (a run whose partner never ran, or ran out of memory) or whose
    two runs are not comparable (``check_comparable``) is left out, with the reason."""
    groups = _folder_groups(runs)
    newest: dict[str, tuple[str, str, dict]] = {}
    left_out = []
    for folder, modes in sorted(groups.items()):
        if set(modes) != set(MODES):
            left_out.append(f"{folder}: only a {'/'.join(sorted(modes))} run")
            continue
        try:
            check_comparable(modes["tik"], modes["stock"])
        except ValueError as e:
            left_out.append(f"{folder}: {str(e).split(';')[0]}")
            continue
        recipe, date = modes["tik"]["recipe"], str(modes["tik"].get("metadata", {}).get("date") or "")
        if recipe in newest and newest[recipe][0] >= date:
            left_out.append(f"{folder}: an older pair of {recipe} than {newest[recipe][1]}")
            continue
        if recipe in newest:
            left_out.append(f"{newest[recipe][1]}: an older pair of {recipe} than {folder}")
        newest[recipe] = (date, folder, modes)
    return [run for _, _, modes in newest.values() for run in modes.values()], left_out


def tokens_per_second(steps: list[dict]) -> float:
    seconds = sum(s["step_seconds"] for s in steps)
    return sum(s["tokens"] for s in steps) / seconds if steps and seconds > 0 else float("nan")


def process_tokens_per_second(run: dict) -> float:
    """All tokens over the process's seconds less the checkpoint's; NaN for a run file
    without them."""
    if run.get("process_seconds") is None or run.get("checkpoint_seconds") is None:
        return float("nan")
    seconds = run["process_seconds"] - run["checkpoint_seconds"]
    return sum(s["tokens"] for s in run["per_step"]) / seconds if seconds > 0 else float("nan")


def startup_seconds(run: dict) -> float:
    value = run.get("startup_seconds")
    return float("nan") if value is None else value


def reward_ratios(tik: dict, stock: dict) -> list[float]:
    """tik/stock reward per step, leaving out steps where the stock reward is 0."""
    return [a["reward"] / b["reward"] for a, b in zip(tik["per_step"], stock["per_step"])
            if b["reward"] != 0 and not math.isnan(a["reward"] + b["reward"])]


DELTA_MIN_Z = 3.0  # a mean this many of its standard errors from 0, or no delta-method error


class RatioOfMeans(NamedTuple):
    ratio: float           # mean tik reward / mean stock reward, over the steps both have a reward
    se: float              # its standard error, paired by step (the steps' shared prompts cancel)
    se_unpaired: float     # the same, each run's steps taken as independent of the other's
    step_correlation: float  # Pearson correlation of the two runs' per-step rewards


def reward_ratio_of_means(tik: dict, stock: dict) -> RatioOfMeans:
    """The ratio of the two runs' mean rewards and its standard error by the delta method.

    Both runs of a comparable pair draw the same prompts at the same step (same seeds, data
    and batch sizes: ``pair_runs`` refuses others), so a batch that is easy or hard, and the
    learning curve both runs climb, move both rewards together. The paired error keeps that
    covariance: with a, b the per-step rewards over n paired steps,
    (se / R)^2 = (var a / a^2 + var b / b^2 - 2 cov(a, b) / (a b)) / n (sample moments).
    ``se_unpaired`` drops the covariance term: what the error would be for two unrelated
    runs, wider whenever the steps' rewards correlate. NaN when a mean is 0 or fewer than
    two steps have both rewards; both errors NaN (the ratio kept) when either mean lies within
    ``DELTA_MIN_Z`` of its standard errors of 0: the ratio then has no usable normal
    approximation (Fieller: its confidence interval is unbounded when the denominator's is
    not away from 0), as at the random-weight recipes' rewards, nonzero at one step of
    twenty, where the paired term would print a zero error for a ratio drawn from one
    sample."""
    nan = RatioOfMeans(*(float("nan"),) * 4)
    steps = [(a["reward"], b["reward"]) for a, b in zip(tik["per_step"], stock["per_step"])
             if not (math.isnan(a["reward"]) or math.isnan(b["reward"]))]
    n = len(steps)
    if n < 2:
        return nan
    ma, mb = (sum(x[i] for x in steps) / n for i in (0, 1))
    if ma == 0.0 or mb == 0.0:
        return nan
    va = sum((a - ma) ** 2 for a, _ in steps) / (n - 1)
    vb = sum((b - mb) ** 2 for _, b in steps) / (n - 1)
    cov = sum((a - ma) * (b - mb) for a, b in steps) / (n - 1)
    ratio = ma / mb
    corr = cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")
    if max(va / ma ** 2, vb / mb ** 2) / n > 1 / DELTA_MIN_Z ** 2:  # a mean within 3 s.e. of 0
        return RatioOfMeans(ratio, float("nan"), float("nan"), corr)
    unpaired = va / ma ** 2 + vb / mb ** 2
    paired = max(unpaired - 2 * cov / (ma * mb), 0.0)
    return RatioOfMeans(ratio, abs(ratio) * math.sqrt(paired / n), abs(ratio) * math.sqrt(unpaired / n), corr)


def pooled_ratio(rows: list[dict]) -> tuple[float, float, int]:
    """The inverse-variance weighted mean of the rows' ratios of mean rewards, its standard
    error 1 / sqrt(sum of weights), and how many rows it pools: one estimate from
    independent pairs (different recipes, or replicates of one), weighting each by how
    precisely its pair measured it. Rows without a finite positive error are left out; NaN when none is left."""
    kept = [(r["reward_ratio_of_means"], r["reward_ratio_of_means_se"]) for r in rows
            if math.isfinite(r["reward_ratio_of_means"]) and math.isfinite(r["reward_ratio_of_means_se"])
            and r["reward_ratio_of_means_se"] > 0]
    if not kept:
        return float("nan"), float("nan"), 0
    weights = [1 / se ** 2 for _, se in kept]
    return sum(w * x for w, (x, _) in zip(weights, kept)) / sum(weights), 1 / math.sqrt(sum(weights)), len(kept)


def _mean(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def _spread(values) -> float:
    mean = _mean(values)
    return math.sqrt(_mean([(v - mean) ** 2 for v in values])) if values else float("nan")


def real_weights(recipe: str) -> bool:
    """Whether ``recipe`` trains a model with real (pretrained) weights: the only models
    whose reward moves, so the reward ratio's target is stated over them (a random-weight
    model's reward stays near 0, and one lucky sample gives a ratio of 0 or infinity)."""
    from areal_tik.adapter.recipes import CARDS, SMOLLM2

    return any(c.name == recipe and c.model == SMOLLM2 for c in CARDS)


def stock_decode(run: dict) -> str:
    """The stock run's path: its paged decode attention, with "+ torch.compile" when its
    engine compiled the standard elementwise ops, its trainer's token log-prob, and the
    trainer's model code when it is AReaL's over the Hugging Face model, and its packed
    attention when a GPU run fell back to SDPA per sequence. Run files from
    before a field ran what the standard set then had: the gather decode, eagerly, the
    log-prob materialised in fp32 over all rows, this project's model code."""
    meta = run.get("metadata", {})
    path = meta.get("decode_attention") or "gather-sdpa"
    path = f"{path} + torch.compile" if meta.get("compiled_ops") else path
    logprob = re.sub(r" \(.*?\)", "", meta.get("logprob") or "materialised-fp32")
    trainer = "; trainer AReaL FSDP over the HF model" if meta.get("training_model") == "hf" else ""
    if "sdpa-per-sequence fallback" in (meta.get("training_attention") or ""):
        trainer += "; training attention SDPA per sequence (varlen fallback)"
    return f"{path}; log-prob {logprob}{trainer}"


def summary_row(pair: Pair, warmup: int) -> dict:
    tik, stock = pair.tik["per_step"], pair.stock["per_step"]
    ratios = reward_ratios(pair.tik, pair.stock)
    of_means = reward_ratio_of_means(pair.tik, pair.stock)
    audit = pair.tik["summary"]
    return {
        "recipe": pair.recipe, "steps": pair.tik["steps"], "warmup": warmup,
        "throughput_whole": tokens_per_second(tik) / tokens_per_second(stock),
        "throughput_steady": tokens_per_second(tik[warmup:]) / tokens_per_second(stock[warmup:]),
        "throughput_process": process_tokens_per_second(pair.tik) / process_tokens_per_second(pair.stock),
        "startup_seconds_tik": startup_seconds(pair.tik), "startup_seconds_stock": startup_seconds(pair.stock),
        "reward_tik": _mean([s["reward"] for s in tik]), "reward_stock": _mean([s["reward"] for s in stock]),
        "reward_ratio_mean": _mean(ratios), "reward_ratio_spread": _spread(ratios),
        "reward_ratio_steps": len(ratios), "reward_ratio_of_means": of_means.ratio,
        "reward_ratio_of_means_se": of_means.se, "reward_ratio_of_means_se_unpaired": of_means.se_unpaired,
        "reward_step_correlation": of_means.step_correlation, "real_weights": real_weights(pair.recipe),
        "audit": audit.get("verdict", "none"), "audited_tokens": audit.get("audited_tokens", 0),
        "stock_decode": stock_decode(pair.stock), "run": run_label(pair),
    }


def run_label(pair: Pair) -> str:
    """Where the pair ran: the GPU and the commit (both runs' when they differ)."""
    tik, stock = pair.tik.get("metadata", {}), pair.stock.get("metadata", {})
    label = lambda key: (str(tik.get(key)) if tik.get(key) == stock.get(key)  # noqa: E731
                         else f"tik {tik.get(key)} / stock {stock.get(key)}")
    return f"{label('gpu')}, {label('commit')}"


def _path_key(stock_path: str) -> str:
    """A stock path without its parenthesised details: the unit the means are split by."""
    return re.sub(r" \(.*?\)", "", stock_path)


def summary_table(pairs: list[Pair], warmup: int, catalogue: bool = False,
                  replicates: list[Pair] | None = None) -> tuple[list[dict], dict]:
    """Rows per recipe and the means over recipes (NaN cells left out of the means;
    ``throughput_process_configurations``: how many rows that mean has;
    ``reward_ratio_mean_real``: the reward ratio's mean over the real-weight recipes,
    ``reward_ratio_real_configurations`` of them; ``reward_ratio_of_means_real_pooled`` (``_se``,
    ``_configurations``): their ratios of mean rewards pooled by ``pooled_ratio``; with
    ``replicates`` (every comparable pair, superseded ones included: ``every_comparable_pair``),
    ``reward_ratio_of_means_real_replicates`` (``_se``, ``_configurations``): the same pooling
    over all of their real-weight pairs; ``stock_decode_paths``: the stock runs'
    paths (``stock_decode``), more than one when the means mix baselines, and then
    ``by_stock_path``: the throughput means over each path's rows; ``gpus``: the GPUs
    the pairs ran on, more than one when the means mix devices). With ``catalogue``:
    ``recipes_without_pair``, the end-to-end recipes with no row (a report over all results)."""
    rows = [summary_row(p, warmup) for p in pairs]
    means = {key: _mean([r[key] for r in rows])
             for key in ("throughput_whole", "throughput_steady", "throughput_process", "reward_ratio_mean")}
    means["throughput_process_configurations"] = sum(not math.isnan(r["throughput_process"]) for r in rows)
    real = [r["reward_ratio_mean"] for r in rows if r["real_weights"]]
    means["reward_ratio_mean_real"] = _mean(real)
    means["reward_ratio_real_configurations"] = len(real)
    (means["reward_ratio_of_means_real_pooled"], means["reward_ratio_of_means_real_pooled_se"],
     means["reward_ratio_of_means_real_pooled_configurations"]) = pooled_ratio([r for r in rows if r["real_weights"]])
    if replicates is not None:
        real_pairs = [summary_row(p, warmup) for p in replicates if real_weights(p.recipe)]
        (means["reward_ratio_of_means_real_replicates"], means["reward_ratio_of_means_real_replicates_se"],
         means["reward_ratio_of_means_real_replicates_configurations"]) = pooled_ratio(real_pairs)
    # a mean over pairs whose stock runs decoded differently mixes two baselines: said, not hidden
    means["stock_decode_paths"] = sorted({_path_key(r["stock_decode"]) for r in rows})
    means["gpus"] = sorted({str(p.tik.get("metadata", {}).get("gpu")) for p in pairs})
    if len(means["stock_decode_paths"]) > 1:  # the same means over the rows of each stock path
        means["by_stock_path"] = {
            path: {"configurations": len(group), **{key: _mean([r[key] for r in group]) for key in
                                                     ("throughput_whole", "throughput_steady", "throughput_process")}}
            for path in means["stock_decode_paths"]
            for group in [[r for r in rows if _path_key(r["stock_decode"]) == path]]}
    if catalogue:
        from areal_tik.adapter.recipes import END_TO_END

        means["recipes_without_pair"] = [name for name in END_TO_END if name not in {r["recipe"] for r in rows}]
    return rows, {**means, "paper_throughput": PAPER_THROUGHPUT, "paper_reward": PAPER_REWARD}
