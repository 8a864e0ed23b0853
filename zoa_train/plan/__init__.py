"""The cost and memory model: what a recipe would send and cost on a cluster, and what each rank would
hold, without running it (`zoa-train plan`).

  counts.py  what the optimizers' registry entries count (PlanContext, PlanCounts, MemoryCounts, ...)
  model.py   the plan: each optimizer's counts priced on a Cluster of nodes, step times, memory per rank
  units.py   bandwidths, latencies and sizes read from text and printed
  table.py   the plan as a table
  recipe.py  `zoa-train plan` on a recipe: the model's shapes and activations, the plan, printed
"""
