"""The linear algebra of the Newton iterations: one subpackage per family of
implementations of `AbstractLinearSolver` (`linear_solver.py`: the interface and
`DenseLU`), with their kernels beside them.

- `linear_solver.py`: the interface, the iteration matrix J = ∂F/∂y + cj ∂F/∂y' by
  `jax.jacfwd`, the equilibrated dense LU (`DenseLU`).
- `jacobian.py`: sparsity detection (`Sparsity`), column colouring, J from coloured
  `jax.jvp`s.
- `banded.py` (`BandedLU`) and its kernels: the pure-JAX block LU (in `banded.py`) and
  LAPACK's gbtrf/gbtrs as XLA FFI custom calls (`band_lapack.py`, compiled by numba in
  `lapack_ffi.py`).
- `sparse.py` (`SparseLU`, `default_linear_solver`): a band LU after a bandwidth-reducing
  reordering, or KLU (`klu.py`).
- `krylov.py`: matrix-free GMRES (`Krylov`) and user preconditioners
  (`AbstractPreconditioner`, its function-pair form `Preconditioner`), which are not
  linear solvers: they only approximate the iteration matrix for `Krylov`.

Nothing here is imported by this `__init__`: the integrator and the derivatives import the
modules they need (the package's `__init__` re-exports the public classes).
"""
