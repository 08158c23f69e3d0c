"""Comparison reports of recipe runs (``areal-tik report``): tik vs stock per recipe.

``runs``: read the run files, pair tik and stock runs of one recipe (refusing a pair
that is not comparable) and compute the summary table; ``page``: the static HTML page
with PNG plots; ``wandb_report``: the same as a W&B Report when online (optional).
"""
