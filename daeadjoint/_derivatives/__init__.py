"""How JAX's transformations reach the solver: the derivative machinery.

- `autodiff.py`: `solve_core`, the `jax.custom_jvp` around the solve, and its primitives
  (the tangent L(x) ẋ, the cotangent L(x)ᵀ ȳ, the Hessian and the fused primal-and-tangent
  run); `batching.py`: their batching rules (a batch of tangents or cotangents becomes the
  directions of one integration); `tangents.py`: the tangents of the differentiable inputs
  (which inputs carry one, zeros for the others).
- `forward_sensitivity.py`: forward sensitivities (IDAS's staggered corrector), the
  implementation of the tangent.
- `adjoint.py` (`Adjoint`): the continuous adjoint DAE integrated backward with checkpoint
  recomputation; `discrete_adjoint.py` (`DiscreteAdjoint`): the adjoint of the recorded
  discrete steps. Either is the implementation of the cotangent (`sensitivity=`); both
  implement `reverse.py`'s `AbstractAdjoint`, the interface the autodiff rules call.
- `augmented.py`: the DAE augmented with one sensitivity direction, whose solves give
  the second and higher derivatives.

Nothing here is imported by this `__init__`: the integrator (`_core.py`) imports
`forward_sensitivity.py`, which must not pull in the adjoints (they import the integrator).
"""
