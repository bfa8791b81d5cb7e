"""daeadjoint: a JAX-native, differentiable variable-order BDF solver for DAEs
F(t, y, y', args) = 0 in the SUNDIALS IDAS tradition."""

from ._adjoint import Adjoint
from ._discrete_adjoint import DiscreteAdjoint
from ._events import Event
from ._forward_sensitivity import ForwardSensitivity
from ._banded import BandedLU
from ._jacobian import Sparsity, SparsityDetectionError
from ._krylov import Krylov, Preconditioner
from ._linear_solver import AbstractLinearSolver, DenseLU
from ._results import RESULTS
from ._solution import Solution
from ._solve import solve
from ._sparse import SparseLU, default_linear_solver

__all__ = ["solve", "Solution", "RESULTS", "DenseLU", "BandedLU", "SparseLU", "Krylov",
           "Preconditioner", "Sparsity", "SparsityDetectionError", "default_linear_solver",
           "AbstractLinearSolver", "Adjoint", "DiscreteAdjoint", "Event", "ForwardSensitivity"]
__version__ = "0.1.0"
