"""daeadjoint: a JAX-native, differentiable variable-order BDF solver for DAEs
F(t, y, y', args) = 0 in the SUNDIALS IDAS tradition."""

from ._derivatives.adjoint import Adjoint
from ._derivatives.discrete_adjoint import DiscreteAdjoint
from ._derivatives.forward_sensitivity import ForwardSensitivity
from ._ensemble import ensemble, solve_ensemble
from ._events import Event
from ._linalg.banded import BandedLU
from ._linalg.jacobian import Sparsity, SparsityDetectionError
from ._linalg.krylov import AbstractPreconditioner, Krylov, Preconditioner
from ._linalg.linear_solver import AbstractLinearSolver, DenseLU
from ._linalg.sparse import SparseLU, default_linear_solver
from ._results import RESULTS
from ._solution import EventRoots, Solution
from ._solve import solve

__all__ = ["solve", "solve_ensemble", "ensemble", "Solution", "RESULTS", "DenseLU", "BandedLU", "SparseLU", "Krylov",
           "Preconditioner", "AbstractPreconditioner", "Sparsity", "SparsityDetectionError",
           "default_linear_solver", "AbstractLinearSolver", "Adjoint", "DiscreteAdjoint",
           "Event", "EventRoots", "ForwardSensitivity"]
__version__ = "0.1.0"
