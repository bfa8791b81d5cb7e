"""One way to configure: strategies are objects or `Literal` strings checked by name, what
a diffrax or lineax user passes by habit gets an error saying what to pass instead, and
the event outputs are grouped in `sol.events` while the names of DESIGN.md still work.

The argument errors are raised before anything is compiled. diffrax is not a dependency:
its objects are stood in for by small classes defined in a module named like diffrax's
(what the checks look at), and the real ones are tried only where diffrax is installed.
"""

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest

import daeadjoint as dae
from daeadjoint._derivatives.reverse import AbstractAdjoint
from .problems import oscillator

RTOL = 1e-8
# The exact-solution tests' bound (tests/test_events.py): 100·rtol, relative.
BOUND = 100 * RTOL


def decay(t, y, yp, args):
    return yp + y


def solve_decay(**kwargs):
    return dae.solve(decay, 0.0, 1.0, jnp.ones(1), -jnp.ones(1), **kwargs)


def _stand_in(module, name, bases=(), **attrs):
    """An instance of a class `name` defined in `module` (e.g. "diffrax._adjoint")."""
    cls = type(name, bases, {"__module__": module, **attrs})
    return cls()


# ------------------------------------------------------- strategies as Literal strings


@pytest.mark.parametrize("init", ["YA_YDP", "ya-ydp", "yp", ""])
def test_init_names_its_allowed_values(init):
    with pytest.raises(ValueError, match=r"`init` must be None or one of 'ya_ydp', 'y'; "
                                         f"got '{init}'"):
        solve_decay(init=init)


def test_adjoint_interpolation_names_its_allowed_values():
    with pytest.raises(ValueError, match=r"interpolation=\.\.\.\) must be one of 'hermite', "
                                         r"'bdf'; got 'cubic'"):
        dae.Adjoint(interpolation="cubic")


# ------------------------------------------------------------- the reverse-mode base


def test_reverse_modes_share_an_abstract_base():
    """`solve` accepts any `AbstractAdjoint` (both reverse modes are one), and the base
    declares the two methods the autodiff rules call: a subclass without them cannot be
    built."""
    assert isinstance(dae.Adjoint(), AbstractAdjoint)
    assert isinstance(dae.DiscreteAdjoint(), AbstractAdjoint)

    class Incomplete(AbstractAdjoint):
        def recorders(self, state, yp0, max_steps):
            return ()

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()
    with pytest.raises(TypeError, match=r"`sensitivity` must be daeadjoint.Adjoint\(\)"):
        solve_decay(sensitivity="adjoint")


# ---------------------------------------------------- a diffrax user's first tries


SAVEAT = _stand_in("diffrax._saveat", "SaveAt", subs=None)


@pytest.mark.parametrize("saveat, match", [
    (SAVEAT, r"not a SaveAt object\. For diffrax's SaveAt\(ts=ts\) pass saveat=ts"),
    # Any object with output times as an attribute: pass the times themselves.
    (_stand_in("mylib", "Grid", ts=np.linspace(0, 1, 3)), "pass saveat=ts"),
    ({"ts": [0.5, 1.0]}, "must be a 1-D array of output times, got a dict"),
], ids=["diffrax_saveat", "object_with_ts", "dict"])
def test_saveat_objects_say_what_to_pass(saveat, match):
    with pytest.raises(TypeError, match=match):
        solve_decay(saveat=saveat)


def test_max_steps_none_says_why_and_what_to_pass():
    with pytest.raises(ValueError, match=r"None \(no limit, as diffrax allows\) is not "
                                         r"supported.*sized by max_steps"):
        solve_decay(max_steps=None)


@pytest.mark.parametrize("name, bases, match", [
    ("BacksolveAdjoint", (), r"pass sensitivity=daeadjoint\.Adjoint\(\)"),
    ("RecursiveCheckpointAdjoint", (), r"pass sensitivity=daeadjoint\.DiscreteAdjoint\(\)"),
    ("DirectAdjoint", (), r"pass sensitivity=daeadjoint\.DiscreteAdjoint\(\)"),
    ("ForwardMode", (), r"Forward mode needs no option.*forward_sensitivity="),
    # A diffrax solver: its classes derive from diffrax's AbstractSolver.
    ("Kvaerno5", (type("AbstractSolver", (), {}),), r"diffrax\.Kvaerno5 is an integrator"),
])
def test_diffrax_adjoint_or_solver_as_sensitivity_names_the_counterpart(name, bases, match):
    obj = _stand_in("diffrax._adjoint", name, bases)
    with pytest.raises(TypeError, match=match):
        solve_decay(sensitivity=obj)


def test_diffrax_term_as_residual_says_to_pass_the_function():
    term = _stand_in("diffrax._term", "ODETerm")
    with pytest.raises(TypeError, match=r"pass the function itself.*F = yp - f\(t, y, args\)"):
        dae.solve(term, 0.0, 1.0, jnp.ones(1), -jnp.ones(1))


@pytest.mark.parametrize("solver, instead", [
    (lx.LU(), r"daeadjoint\.DenseLU\(\)"),
    (lx.QR(), r"daeadjoint\.DenseLU\(\)"),
    (lx.Tridiagonal(), r"daeadjoint\.BandedLU\(1, 1\)"),
    (lx.GMRES(rtol=1e-6, atol=1e-6), r"daeadjoint\.Krylov\(preconditioner=\.\.\.\)"),
], ids=["LU", "QR", "Tridiagonal", "GMRES"])
def test_lineax_solver_names_the_daeadjoint_solver(solver, instead):
    with pytest.raises(TypeError, match=r"solves a given operator; daeadjoint's solvers build, "
                                        rf"factor.*pass {instead}"):
        solve_decay(linear_solver=solver)


def test_real_diffrax_objects_if_installed():
    """The same errors for the real diffrax objects (where diffrax is installed)."""
    diffrax = pytest.importorskip("diffrax")
    with pytest.raises(TypeError, match="pass saveat=ts"):
        solve_decay(saveat=diffrax.SaveAt(ts=jnp.array([0.5, 1.0])))
    with pytest.raises(TypeError, match=r"sensitivity=daeadjoint\.Adjoint\(\)"):
        solve_decay(sensitivity=diffrax.BacksolveAdjoint())
    with pytest.raises(TypeError, match=r"sensitivity=daeadjoint\.DiscreteAdjoint\(\)"):
        solve_decay(sensitivity=diffrax.RecursiveCheckpointAdjoint())
    with pytest.raises(TypeError, match="is an integrator"):
        solve_decay(sensitivity=diffrax.Kvaerno5())
    with pytest.raises(TypeError, match="pass the function itself"):
        dae.solve(diffrax.ODETerm(lambda t, y, a: -y), 0.0, 1.0, jnp.ones(1), -jnp.ones(1))


# ------------------------------------------------------------ grouped event outputs


def _oscillator_roots(c):
    """x0 = sin(√c t)/√c crosses zero downward at t = π/√c and 3π/√c (x1 = cos(√c t) =
    −1 there)."""
    ev = dae.Event(lambda t, y, yp, a: y[0], terminal=False, direction=-1, max_roots=2)
    return dae.solve(oscillator, 0.0, 12.0, jnp.array([0.0, 1.0]),
                     jnp.array([1.0, 0.0]), jnp.stack([c]), event=ev,
                     rtol=RTOL, atol=RTOL)


def test_events_grouped_and_reachable_by_their_old_names_under_vmap():
    """`sol.events` holds every root; `event_t`, `event_y`, `event_yp`, `event_mask` are
    its first row and `event_ts`, … the whole arrays — also for a batch from jax.vmap,
    whose axis comes first (c = 1 and 4: roots π/√c, 3π/√c exactly, to 100·rtol)."""
    c = jnp.array([1.0, 4.0])
    sol = jax.vmap(_oscillator_roots)(c)
    assert isinstance(sol.events, dae.EventRoots)
    exact = np.pi * np.array([[1.0, 3.0]]) / np.sqrt(np.asarray(c))[:, None]
    np.testing.assert_allclose(np.asarray(sol.events.ts), exact, rtol=BOUND)
    assert sol.event_ts is sol.events.ts and sol.event_ys is sol.events.ys
    assert sol.event_yps is sol.events.yps and sol.event_masks is sol.events.masks
    np.testing.assert_array_equal(np.asarray(sol.event_t), np.asarray(sol.events.ts[:, 0]))
    assert sol.event_y.shape == sol.event_yp.shape == (2, 2)
    np.testing.assert_array_equal(np.asarray(sol.event_y), np.asarray(sol.events.ys[:, 0]))
    np.testing.assert_array_equal(np.asarray(sol.event_yp), np.asarray(sol.events.yps[:, 0]))
    np.testing.assert_allclose(np.asarray(sol.event_y), [[0.0, -1.0], [0.0, -1.0]],
                               rtol=0, atol=BOUND)
    np.testing.assert_array_equal(np.asarray(sol.event_mask), [[True], [True]])


def test_no_event_no_event_outputs():
    sol = solve_decay()
    assert sol.events is None
    assert all(getattr(sol, name) is None for name in (
        "event_t", "event_y", "event_yp", "event_mask", "event_ts", "event_ys", "event_yps",
        "event_masks"))


def test_private_sentinel_still_refuses_derivatives_of_step_data():
    """The step data depend on step sizes, which are never differentiated: under
    jax.grad they raise (through `Solution._sentinel`), outside they are values."""
    def first_step_value(c, dense):
        sol = dae.solve(oscillator, 0.0, 1.0, jnp.array([0.0, 1.0]), jnp.array([1.0, 0.0]),
                        jnp.stack([c]), steps=not dense, dense=dense)
        return sol.step_ys[1, 0]

    assert float(first_step_value(1.0, False)) > 0.0    # x0 = sin t > 0 after the first step
    with pytest.raises(ValueError, match=r"sol\.step_ys is not differentiable"):
        jax.grad(first_step_value)(1.0, False)
