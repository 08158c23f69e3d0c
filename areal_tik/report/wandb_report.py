"""The comparison as a W&B Report (``wandb-workspaces``' report API; online only).

Optional: ``areal-tik report --wandb-project P [--wandb-entity E]`` calls ``publish``;
nothing else imports it, and no test runs it (it needs the network). One panel grid per
recipe, its run set the recipe's two runs (W&B run names ``<recipe>-tik`` and
``<recipe>-stock``), with the reward, the rates, the phase times and the audit metrics.
"""
from __future__ import annotations

from .runs import Pair

PANELS = (
    ("task reward", ["ppo_actor/task_reward/avg"]),
    ("tokens/s", ["tik_run/tokens_per_s"]),
    ("step time by phase (s)", ["timeperf/rollout", "timeperf/recompute_logp", "timeperf/train_step",
                                "timeperf/update_weights"]),
    ("audit", ["tik/audit_passed", "tik/bitwise_fraction"]),
)


def publish(pairs: list[Pair], entity: str | None, project: str) -> str:
    """Save the report; returns its URL. ImportError names the package when it is absent."""
    try:
        import wandb_workspaces.reports.v2 as wr
    except ImportError as exc:
        raise ImportError("a W&B Report needs the wandb-workspaces package (pip install wandb-workspaces); "
                          "the HTML report was written without it") from exc
    blocks = [wr.H1("areal-tik: flag on (tik) vs stock path")]
    for pair in pairs:
        runset = wr.Runset(entity=entity, project=project, name=pair.recipe, query=pair.recipe)
        panels = [wr.LinePlot(title=title, x="Step", y=ys) for title, ys in PANELS]
        blocks += [wr.H2(pair.recipe), wr.PanelGrid(runsets=[runset], panels=panels)]
    report = wr.Report(entity=entity, project=project, title="areal-tik comparison",
                       description="reward, reward ratio, throughput, phases and audits per recipe", blocks=blocks)
    report.save()
    return report.url
