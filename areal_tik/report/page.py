"""The static report: ``index.html`` with the summary table and, per recipe, one PNG
(reward tik vs stock, reward ratio per step, tokens/s, mean phase times) and its audits."""
from __future__ import annotations

import html
import math
from pathlib import Path

from .runs import Pair

PHASE_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")


def fmt(value: float, suffix: str = "x") -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f}{suffix}"


def _steps(run: dict, key: str) -> tuple[list[int], list[float]]:
    return [s["step"] for s in run["per_step"]], [s[key] for s in run["per_step"]]


NO_RATIO = "no step with a non-zero stock reward,\nso no reward ratio"


def draw_reward_ratio(ax, pair: Pair) -> None:
    """tik/stock reward per step; where no step has a non-zero stock reward (random-weight
    models reward 0 throughout), a text saying so instead of an empty axis."""
    if not any(s["reward"] != 0 and not math.isnan(s["reward"]) for s in pair.stock["per_step"]):
        steps = _steps(pair.stock, "reward")[0]
        ax.text(0.5, 0.5, NO_RATIO, transform=ax.transAxes, ha="center", va="center", color="#555")
        ax.set_yticks([])
        if steps:
            ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
        return
    ratio = [a["reward"] / b["reward"] if b["reward"] else float("nan")
             for a, b in zip(pair.tik["per_step"], pair.stock["per_step"])]
    ax.plot(_steps(pair.tik, "reward")[0], ratio, marker=".", color="k")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")


def plot_pair(pair: Pair, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((ax_r, ax_q), (ax_t, ax_p)) = plt.subplots(2, 2, figsize=(11, 7))
    # tik as a wide light band, stock as a thin line inside it: equal rewards (the point of
    # the flag) would otherwise draw one curve exactly over the other and hide it.
    for mode, run, style in (("tik", pair.tik, dict(color="C0", marker="o", ms=9, lw=6.0, alpha=0.35)),
                             ("stock", pair.stock, dict(color="C1", marker="x", ms=7, lw=1.5))):
        ax_r.plot(*_steps(run, "reward"), label=mode, **style)
        ax_t.plot(*_steps(run, "tokens_per_s"), label=mode, **style)
    draw_reward_ratio(ax_q, pair)
    phases = list(pair.tik["per_step"][0]["phases"])
    for col, mode_run in enumerate((pair.tik, pair.stock)):
        bottom = 0.0
        for i, phase in enumerate(phases):
            mean = sum(s["phases"][phase] for s in mode_run["per_step"]) / len(mode_run["per_step"])
            ax_p.bar(col, mean, bottom=bottom, color=PHASE_COLORS[i % len(PHASE_COLORS)],
                     label=phase if col == 0 else None)
            bottom += mean
    ax_p.set_xticks([0, 1], ["tik", "stock"])
    for ax in (ax_r, ax_q, ax_t):
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax_r.set(title="task reward", xlabel="step")
    ax_q.set(title="reward ratio tik/stock", xlabel="step")
    ax_t.set(title="tokens/s (prompt + generated)", xlabel="step")
    ax_p.set(title="mean seconds per step by phase")
    ax_r.legend()
    ax_p.set_xlim(-0.5, 2.6)  # room on the right for the legend: it would cover the tik bar
    ax_p.legend(fontsize=7, loc="upper right")
    fig.suptitle(pair.recipe)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


SUMMARY_COLUMNS = (("recipe", "recipe"), ("steps", "steps"), ("throughput_whole", "throughput tik/stock (whole run)"),
                   ("throughput_steady", "throughput tik/stock (steady state)"),
                   ("throughput_process", "throughput tik/stock (whole process)"),
                   ("reward_ratio_mean", "reward ratio (mean)"), ("reward_ratio_spread", "reward ratio (spread)"),
                   ("audit", "audit"), ("stock_decode", "stock path (decode attention, compiled ops; training log-prob)"),
                   ("reward_ratio_of_means", "reward ratio of the runs' mean rewards (+/- 1 s.e., paired by step; "
                                             "unpaired s.e.)"),
                   ("run", "GPU, commit"))


def _cell(key: str, row: dict) -> str:
    value = row[key]
    if key in ("throughput_whole", "throughput_steady", "throughput_process", "reward_ratio_mean"):
        return fmt(value)
    if key == "reward_ratio_spread":
        return fmt(value, "")
    if key == "reward_ratio_of_means":
        return (f"{fmt(value)} +/- {fmt(row['reward_ratio_of_means_se'], '')} "
                f"({fmt(row['reward_ratio_of_means_se_unpaired'], '')})")
    return html.escape(str(value))


def _tr(cls: str, cells: list[str]) -> str:
    """A summary row of ``cells``, padded with empty cells to the table's columns."""
    cells = cells + [""] * (len(SUMMARY_COLUMNS) - len(cells))
    return f"<tr class='{cls}'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def summary_html(rows: list[dict], means: dict) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in SUMMARY_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{_cell(k, r)}</td>" for k, _ in SUMMARY_COLUMNS) + "</tr>"
                   for r in rows)
    having = means["throughput_process_configurations"]
    process = fmt(means["throughput_process"]) + (f" (over {having})" if 0 < having < len(rows) else "")
    mean = (_tr("mean", [f"mean over {len(rows)} configurations", "", fmt(means["throughput_whole"]),
                         fmt(means["throughput_steady"]), process, fmt(means["reward_ratio_mean"])])
            + _tr("mean", [f"mean over the {means['reward_ratio_real_configurations']} real-weight "
                           "configurations (the reward ratio's target)", "", "", "", "",
                           fmt(means["reward_ratio_mean_real"]), "", "", "",
                           f"{fmt(means['reward_ratio_of_means_real_pooled'])} +/- "
                           f"{fmt(means['reward_ratio_of_means_real_pooled_se'], '')} (pooled by inverse variance over "
                           f"{means['reward_ratio_of_means_real_pooled_configurations']}: those with an error)"])
            + ("" if "reward_ratio_of_means_real_replicates" not in means else
               _tr("mean", ["every comparable real-weight pair, superseded ones included (replicates of the "
                            "reward ratio)", "", "", "", "", "", "", "", "",
                            f"{fmt(means['reward_ratio_of_means_real_replicates'])} +/- "
                            f"{fmt(means['reward_ratio_of_means_real_replicates_se'], '')} (pooled over "
                            f"{means['reward_ratio_of_means_real_replicates_configurations']})"]))
            + "".join(_tr("mean", [f"mean over the {m['configurations']} with stock path {html.escape(path)}", "",
                                   fmt(m["throughput_whole"]), fmt(m["throughput_steady"]), fmt(m["throughput_process"])])
                      for path, m in means.get("by_stock_path", {}).items())
            + _tr("paper", ["paper (H20)", "", fmt(means["paper_throughput"]), "", "", fmt(means["paper_reward"])]))
    paths = means.get("stock_decode_paths", [])
    mixed = ("" if len(paths) < 2 else
             f"<p class='note'>These means mix stock runs on different paths "
             f"({html.escape(', '.join(paths))}; the decode attention, '+ torch.compile' where the "
             f"engine compiled its elementwise ops, and the trainer's log-prob): the stock baseline is not "
             f"the same in every row.</p>")
    gpus = means.get("gpus", [])
    if len(gpus) > 1:
        mixed += (f"<p class='note'>These means mix pairs measured on different GPUs "
                  f"({html.escape(', '.join(gpus))}): each ratio compares two runs on one machine.</p>")
    if means.get("recipes_without_pair"):
        missing = means["recipes_without_pair"]
        mixed += (f"<p class='note'>{len(missing)} of the end-to-end recipes have no comparable pair here: "
                  f"{html.escape(', '.join(missing))}.</p>")
    if means.get("left_out"):
        mixed += ("<p class='note'>Run files left out (the newest comparable pair of each recipe is kept):</p><ul>"
                  + "".join(f"<li class='note'>{html.escape(line)}</li>" for line in means["left_out"]) + "</ul>")
    return f"<table id='summary'><tr>{head}</tr>{body}{mean}</table>{mixed}"


def audit_html(pair: Pair) -> str:
    def passed(value) -> str:
        return "no audit" if value is None or math.isnan(value) else ("yes" if value == 1.0 else "NO")

    rows = "".join(f"<tr><td>{s['step']}</td><td>{passed(s['tik'].get('audit_passed'))}</td>"
                   f"<td>{fmt(s['tik'].get('bitwise_fraction', float('nan')), '')}</td>"
                   f"<td>{s['tik'].get('tokens_reused', float('nan'))}</td>"
                   f"<td>{s['tik'].get('tokens_recomputed', float('nan'))}</td></tr>"
                   for s in pair.tik["per_step"])
    return ("<table><tr><th>step</th><th>audit passed</th><th>bitwise fraction</th><th>tokens reused</th>"
            f"<th>tokens recomputed</th></tr>{rows}</table>")


def _seconds(run: dict, key: str) -> str:
    value = run.get(key)
    return "n/a" if value is None or math.isnan(value) else f"{value:.1f} s"


def startup_html(pair: Pair) -> str:
    """Each mode's seconds outside the steps (start-up and teardown), of its process's."""
    def mode(run: dict) -> str:
        if run.get("process_seconds") is None:
            return f"{html.escape(run['mode'])} n/a (no process timing in its run file)"
        written = run.get("checkpoint_seconds") or 0.0
        return (f"{html.escape(run['mode'])} {_seconds(run, 'startup_seconds')} of {_seconds(run, 'process_seconds')}"
                + (f" (and {written:.1f} s writing the checkpoint, not counted)" if written > 0 else ""))
    return ("<p>start-up and teardown (process seconds outside the steps, without writing a missing "
            f"checkpoint): {mode(pair.tik)}; {mode(pair.stock)}</p>")


def meta_html(run: dict) -> str:
    m = run["metadata"]
    keys = ("commit", "gpu", "driver", "torch", "triton", "cuda", "kernel_set", "decode_attention", "compiled_ops", "logprob", "date")
    return f"<p class='meta'>{html.escape(run['mode'])}: " + ", ".join(
        f"{k} {html.escape(str(m.get(k)))}" for k in keys) + "</p>"


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1100px} table{border-collapse:collapse;margin:1em 0}"
         "td,th{border:1px solid #bbb;padding:3px 8px;font-size:13px} tr.mean td{font-weight:bold}"
         "tr.paper td{color:#555} .meta{font-size:12px;color:#444} .note{color:#8a4b00}")


CPU_NOTE = ("<p class='note'>Runs on a CPU: the unified kernels of the tik runs execute under the Triton "
            "interpreter, so their throughput here says nothing about a GPU (the recipes' throughput "
            "comparison is a GPU measurement); rewards and audits are meaningful.</p>")


def _on_cpu(pairs: list[Pair]) -> bool:
    return any(str(p.tik.get("metadata", {}).get("gpu", "")).lower() == "cpu" for p in pairs)


def write_page(out: Path, pairs: list[Pair], rows: list[dict], means: dict, warmup: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    for pair, row in zip(pairs, rows):
        png = plot_pair(pair, out / f"{pair.recipe}.png")
        sections.append(
            f"<h2>{html.escape(pair.recipe)}</h2><img src='{png.name}' width='880'>"
            f"<p>audit: {html.escape(str(row['audit']))} ({row['audited_tokens']} tokens compared); "
            f"W&amp;B group {html.escape(str(pair.tik.get('group')))}</p>"
            + startup_html(pair) + audit_html(pair) + meta_html(pair.tik) + meta_html(pair.stock))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>areal-tik comparison</title>"
            f"<style>{STYLE}</style></head><body><h1>areal-tik: flag on (tik) vs stock path</h1>"
            f"<p>Throughput: tokens/s (prompt + generated), tik over stock. Whole run: all tokens over the "
            f"sum of the wall step times; steady state: the same leaving out the first {warmup} step(s); whole "
            f"process: all tokens over the process's wall time, start-up and teardown included (AReaL init, "
            f"model load, the kernels' device qualification, compilation warm-up, CUDA graph capture), "
            f"writing a missing checkpoint left out (n/a for run files without that timing). Reward ratio: "
            f"tik/stock per step, over steps with a non-zero stock reward (spread: standard deviation); "
            f"and the ratio of the two runs' mean rewards, with its standard error (delta method, from each "
            f"run's per-step spread): a ratio within about two errors of 1.00 is not told from noise.</p>"
            + (CPU_NOTE if _on_cpu(pairs) else "") + summary_html(rows, means) + "".join(sections)
            + "</body></html>")
    path = out / "index.html"
    path.write_text(page)
    return path
