"""The interface of a reverse mode (`solve(sensitivity=...)`): what the forward run records
for it, and the backward pass that turns output cotangents into input cotangents.

`Adjoint` (the continuous adjoint DAE, `adjoint.py`) and `DiscreteAdjoint` (the adjoint of
the recorded BDF steps, `discrete_adjoint.py`) implement it. The autodiff rules
(`autodiff.py`) and the forward run (`_core.run_forward`) call only these two methods, so
`solve` checks `sensitivity` against this base and nothing else.

This module imports nothing from the integrator, so that `_core.py` can name the type
without pulling in the adjoints (which import the integrator).
"""

import abc
from typing import Any

import equinox as eqx


class AbstractAdjoint(eqx.Module):
    """How reverse-mode derivatives of `solve` are computed (the `sensitivity=` option).

    Subclasses are `eqx.Module`s holding their options, and implement:

    - `recorders(state, yp0, max_steps) -> tuple`: the recorders the forward run fills for
      the backward pass (hot-restart checkpoints, the step log, the last segment's
      steps), created from the initial integrator `state` for at most `max_steps` steps.
    - `backward(config, inputs, rec, ct, wanted) -> (cotangents, result)`: the cotangents
      of the differentiable inputs named by `wanted` (a `Tangents` of bools), for k
      output cotangents `ct` stacked on a leading axis, from the forward run's record
      `rec`; and a `RESULTS` item, `RESULTS.successful` unless the backward pass failed.
    """

    @abc.abstractmethod
    def recorders(self, state: Any, yp0: Any, max_steps: int) -> tuple:
        ...

    @abc.abstractmethod
    def backward(self, config: Any, inputs: Any, rec: Any, ct: Any, wanted: Any) -> tuple:
        ...
