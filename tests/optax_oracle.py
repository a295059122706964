"""optax's chain as the oracle of the fused AdamW (`Optimizer.apply`, train/optimizer.py): an
`apply` with the same contract — (grads, state, params, grad_norm, finite, whole, gather) → (new
params, new state) — made of the chain's `update`, `optax.apply_updates` and the non-finite guard
over the whole state (and, ZeRO-1, the guarded parameters gathered back onto their sharding). The
train step itself has one update path, the fused one; tests put this in its place to compare."""
import optax

from MaxText.train.optimizer import Optimizer
from MaxText.train.step import keep_if


def chain_apply(update):
  """`Optimizer.apply` from an optax `update` (the oracle)."""
  def apply(grads, state, params, grad_norm, finite, whole=None, gather=None):
    del grad_norm, whole   # the chain clips by its own norm; the guarded result is gathered
    updates, new_state = update(grads, state, params)
    new_params = keep_if(finite, optax.apply_updates(params, updates), params)
    if gather is not None:
      new_params = gather(new_params)
    return new_params, keep_if(finite, new_state, state)
  return apply


def with_chain(opt: Optimizer) -> Optimizer:
  """`opt` with the optax chain in place of the fused update."""
  return opt._replace(apply=chain_apply(opt.update))
