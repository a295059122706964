"""Expert-load collapse: a warning when the router sends (nearly) every token to the same experts.

`KEY` (`moe_load_max_over_mean`: the worst layer's busiest expert over the mean load, per step;
MaxText/layers/moe.py computes it) is 1.0 for an even load and num_experts / num_experts_per_tok
when every token picks the same k experts (the worst possible). `CollapseWatch` puts it on the
progress line and warns once the value has stayed above `COLLAPSE_FRACTION` of that worst for
`PATIENCE` steps in a row, and again only after the load recovered and collapsed anew. What the
run does about balancing, and what to change, come from the caller (the MoE layer's `MoETerms`).
"""
from __future__ import annotations

COLLAPSE_FRACTION = 0.5
PATIENCE = 10
KEY = "moe_load_max_over_mean"


class CollapseWatch:
  def __init__(self, num_experts: int, experts_per_token: int, *, balancing: str, advice: str):
    self.worst = num_experts / max(experts_per_token, 1)
    self.k = experts_per_token
    self.balancing = balancing   # what the run does about it, for the message
    self.advice = advice         # what to change
    self.run = 0                 # consecutive collapsed steps
    self.warned = False

  def progress(self, metrics: dict) -> str:
    """The progress line's part: the busiest expert over the mean (1 = even); "" without it."""
    load = metrics.get(KEY)
    return "" if load is None else f"expert load {load:.2f}"

  def update(self, step: int, metrics: dict) -> str | None:
    """The warning to log after `step`, or None."""
    load = metrics.get(KEY)
    if load is None or self.worst <= 1:
      return None
    if load <= COLLAPSE_FRACTION * self.worst:
      self.run, self.warned = 0, False
      return None
    self.run += 1
    if self.run < PATIENCE or self.warned:
      return None
    self.warned = True
    return (f"warning: expert load collapsed: {KEY} above {COLLAPSE_FRACTION * self.worst:.2f} for "
            f"{self.run} steps up to step {step} (now {load:.2f}; {self.worst:.2f} = every token on "
            f"the same {self.k} experts); balancing: {self.balancing}. {self.advice}")
