"""Solver runners and the shared timing code.

Every solver is wrapped as a ``Prepared``: ``run(args)`` performs one complete solve
over ``prob.ts`` for the parameter vector ``args`` (the thing that is timed), and
``result(out, args)`` turns its output into ``(ys, steps)`` afterwards (untimed).
``measure`` times any ``Prepared``; ``batch_sequential`` / ``batch_vmap`` time
parameter sweeps.  Solvers: casadi IDAS, scikit-sundae IDA, diffrax Kvaerno5,
pydiffsol and diffsol-jax (Robertson only; imported when used) and (when importable)
daeadjoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from problems import JAX, Problem, casadi_dae, jax_ode, jax_residual, numpy_residual

MAX_STEPS = 100_000


@dataclasses.dataclass
class Prepared:
    """A ready-to-time solver for one problem."""

    label: str
    run: Callable[[np.ndarray], Any]  # args -> raw output (timed)
    result: Callable[[Any, np.ndarray], tuple[np.ndarray, int]]  # -> (ys (nt, n), steps)
    setup_s: float = 0.0  # time spent building it (casadi: SX + jit compile)


def _timed(fn: Callable, *a) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*a)
    return time.perf_counter() - t, out


# --------------------------------------------------------------------------- timing
def measure(prep: Prepared, args: np.ndarray, repeats: int) -> dict:
    """Time one solve: the first call (warm-up) then the median of ``repeats`` calls.

    compile_or_setup_s = build time + (first call - median), i.e. everything that a
    second identical solve does not pay again (JIT compilation for JAX, SX
    construction and C compilation for casadi).
    """
    first, out = _timed(prep.run, args)
    walls = [_timed(prep.run, args)[0] for _ in range(repeats)]
    median = statistics.median(walls)
    ys, steps = prep.result(out, args)
    return dict(
        label=prep.label,
        wall_median_s=median,
        compile_or_setup_s=prep.setup_s + max(first - median, 0.0),
        steps=int(steps),
        ys=np.asarray(ys),
        y_final=np.asarray(ys)[-1],
    )


def measure_interleaved(preps: dict[str, Prepared], args: np.ndarray, rounds: int) -> dict:
    """``measure`` for several solvers at once, their calls interleaved: one warm-up call
    each, then ``rounds`` rounds of one call of every solver in turn, so that a change of
    the machine's load falls on all of them alike. Returns ``{name: measure's dict}``
    (with ``wall_min_s`` besides the median)."""
    first, outs, walls = {}, {}, {name: [] for name in preps}
    for name, prep in preps.items():
        first[name], outs[name] = _timed(prep.run, args)
    for _ in range(rounds):
        for name, prep in preps.items():
            walls[name].append(_timed(prep.run, args)[0])
    results = {}
    for name, prep in preps.items():
        median = statistics.median(walls[name])
        ys, steps = prep.result(outs[name], args)
        results[name] = dict(label=prep.label, wall_median_s=median, wall_min_s=min(walls[name]),
                             compile_or_setup_s=prep.setup_s + max(first[name] - median, 0.0),
                             steps=int(steps), ys=np.asarray(ys), y_final=np.asarray(ys)[-1])
    return results


def batch_sequential(prep: Prepared, args_batch: np.ndarray) -> dict:
    """Total wall time of solving every parameter set one after another (already warm).
    A member whose solve raises counts in the time and in ``failed``; its row is NaN."""

    def attempt(a):
        try:
            return prep.run(a)
        except Exception:  # noqa: BLE001 - a peer's failure on one member is a result
            return None

    t = time.perf_counter()
    outs = [attempt(a) for a in args_batch]
    total = time.perf_counter() - t
    good = next(o for o in outs if o is not None)
    width = np.shape(prep.result(good, args_batch[0])[0][-1])
    finals = np.stack([np.full(width, np.nan) if o is None else prep.result(o, a)[0][-1]
                       for o, a in zip(outs, args_batch)])
    return dict(label=prep.label + " sequential", total_s=total, compile_or_setup_s=prep.setup_s,
                y_final=finals, failed=sum(o is None for o in outs))


def batch_vmap(label: str, solve: Callable, args_batch: np.ndarray, repeats: int = 1,
               budget_s: float = 10.0) -> dict:
    """``jax.jit(jax.vmap(solve))`` over the batch: ahead-of-time compile time, then the
    median total wall time of up to ``repeats`` runs (fewer once ``budget_s`` is spent)."""
    compile_s, fn = _timed(lambda: jax.jit(jax.vmap(solve)).lower(args_batch).compile())
    walls, spent = [], 0.0
    while len(walls) < max(repeats, 1) and (not walls or spent < budget_s):
        wall, (ys, steps) = _timed(lambda: jax.block_until_ready(fn(args_batch)))
        walls.append(wall)
        spent += wall
    return dict(label=label + " vmap", total_s=statistics.median(walls),
                compile_or_setup_s=compile_s, y_final=np.asarray(ys)[:, -1],
                steps_max=int(np.max(steps)))


def max_rel_diff(y, ref, atol) -> float:
    """max_i |y_i - ref_i| / max(|ref_i|, atol_i)  (atol floors near-zero references)."""
    return float(np.max(np.abs(y - ref) / np.maximum(np.abs(ref), atol)))


# --------------------------------------------------------------------------- casadi IDAS
def prepare_casadi(prob: Problem, jit: bool = True) -> Prepared:
    """casadi IDAS on the semi-explicit form; SX residual + exact sparse Jacobian.

    With ``jit`` the residual and Jacobian are C-compiled with gcc (compiler 'shell');
    falls back to the SX virtual machine when that fails.  IDAS gets the per-component
    ``abstolv`` (in [x; z] order) and a consistent ``init_xdot``; IDACalcIC (casadi's
    default) then only re-checks consistency, which also covers batch parameters.
    (Without ``init_xdot`` IDACalcIC fails on Robertson: it starts from xdot = 0 with a
    step scaled by the last output time 4e10.)  Linear solver: casadi's default sparse
    'qr', measured faster here than 'csparse' (heat: 4.6 vs 8.3 ms).
    """
    import casadi as ca  # imported where used: a machine may have only some of the peers
    atol = np.concatenate([prob.atol[prob.diff_idx], prob.atol[prob.alg_idx]])
    opts = dict(reltol=prob.rtol, abstolv=list(atol), max_num_steps=MAX_STEPS,
                init_xdot=list(prob.yp0(prob.args)[prob.diff_idx]))
    t = time.perf_counter()
    dae = casadi_dae(prob)
    F, label = None, "IDAS (casadi, SX)"
    if jit:
        try:  # casadi writes the C file and .so into the cwd; once dlopened they can go
            with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
                F = ca.integrator("F", "idas", dae, prob.t0, prob.ts,
                                  dict(opts, jit=True, compiler="shell", jit_cleanup=False,
                                       jit_options=dict(flags=["-O2"], cleanup=False)))
            label = "IDAS (casadi, jit)"
        except RuntimeError as e:
            print(f"casadi jit unavailable, using SX: {str(e).splitlines()[-1]}")
    if F is None:
        F = ca.integrator("F", "idas", dae, prob.t0, prob.ts, opts)
    setup = time.perf_counter() - t
    x0, z0 = prob.y0[prob.diff_idx], prob.y0[prob.alg_idx]

    def run(args):
        return F(x0=x0, z0=z0, p=args)

    def result(out, args):
        ys = prob.assemble(np.asarray(out["xf"]), np.asarray(out["zf"]), np).T
        return ys, F.stats()["nsteps"]

    return Prepared(label, run, result, setup)


# --------------------------------------------------------------------------- scikit-sundae
def prepare_sksundae(prob: Problem) -> Prepared:
    """scikit-sundae IDA on the fully implicit numpy residual.

    Jacobian by SUNDIALS difference quotients: dense, or banded when the problem has a
    bandwidth (heat: half-bandwidth M, as in idasHeat2D_bnd).  The IDA object is built
    inside ``run`` (parameters travel as ``userdata``; construction costs microseconds).
    Quirk: sksundae tests ``if userdata`` (truthiness), which raises for numpy arrays of
    length > 1, so the parameters are passed as a tuple of floats.
    sksundae reports no step count, so ``result`` re-integrates once in 'onestep' mode
    (untimed) and counts the internal steps.
    """
    from sksundae.ida import IDA  # imported where used, as casadi above

    resfn = numpy_residual(prob)
    kw = dict(rtol=prob.rtol, atol=prob.atol, algebraic_idx=prob.alg_idx,
              max_num_steps=MAX_STEPS)
    if prob.bandwidth:
        kw.update(linsolver="band", lband=prob.bandwidth, uband=prob.bandwidth)

    def run(args):
        solver = IDA(resfn, userdata=tuple(args), **kw)
        return solver.solve(prob.ts_with_t0, prob.y0, prob.yp0(args))

    def result(out, args):
        if not out.success:
            raise RuntimeError(f"sksundae: {out.message}")
        solver = IDA(resfn, userdata=tuple(args), **kw)
        solver.init_step(prob.t0, prob.y0, prob.yp0(args))
        steps, t = 0, prob.t0
        while t < prob.t1:
            t = solver.step(prob.t1, method="onestep", tstop=prob.t1).t
            steps += 1
        return out.y[1:], steps

    return Prepared("IDA (scikit-sundae)", run, result)


# --------------------------------------------------------------------------- JAX solvers
def diffrax_solve(prob: Problem) -> Callable:
    """args -> (ys (nt, n), num_steps): diffrax Kvaerno5 + PID control on the ODE form."""
    import diffrax  # only for this runner: the other peers do not need it installed

    vector_field, to_full = jax_ode(prob)
    term, solver = diffrax.ODETerm(vector_field), diffrax.Kvaerno5()
    controller = diffrax.PIDController(rtol=prob.rtol, atol=jnp.asarray(prob.atol[prob.diff_idx]))
    x0, saveat = jnp.asarray(prob.y0[prob.diff_idx]), diffrax.SaveAt(ts=jnp.asarray(prob.ts))

    def solve(args):
        sol = diffrax.diffeqsolve(term, solver, prob.t0, prob.t1, None, x0, args=args,
                                  saveat=saveat, stepsize_controller=controller,
                                  max_steps=MAX_STEPS)
        return jax.vmap(to_full, (0, None))(sol.ys, args), sol.stats["num_steps"]

    return solve


def daeadjoint_solve(prob: Problem) -> Callable:
    """args -> (ys (nt, n), num_steps) via ``daeadjoint.solve`` on the implicit residual."""
    import daeadjoint as dae

    residual = jax_residual(prob)
    y0, ts, atol = jnp.asarray(prob.y0), jnp.asarray(prob.ts), jnp.asarray(prob.atol)

    def solve(args):
        sol = dae.solve(residual, prob.t0, prob.t1, y0, prob.yp0(args, JAX), args,
                        saveat=ts, algebraic=prob.algebraic, rtol=prob.rtol, atol=atol,
                        max_steps=MAX_STEPS)
        return sol.ys, sol.stats["num_steps"]

    return solve


def prepare_jax(label: str, solve: Callable) -> Prepared:
    """``jax.jit(solve)``; each run blocks until the result is ready."""
    fn = jax.jit(solve)
    return Prepared(label,
                    run=lambda args: jax.block_until_ready(fn(args)),
                    result=lambda out, args: (np.asarray(out[0]), int(out[1])))


# --------------------------------------------------------------------------- diffsol
# diffsol (Rust; BDF with forward and adjoint sensitivities) takes a scalar atol. IDAS's
# per-component atol a_i is reproduced exactly by solving for the scaled unknowns
# u_i = y_i / a_i with atol = 1: the error test |e_u,i| <= rtol |u_i| + 1 is
# |e_y,i| <= rtol |y_i| + a_i. Both peers are Robertson-only here (their models are
# written in diffsol's DSL, or traced from a jnp function of the ODE form).
ROBERTSON_DIFFSL = """
in_i {{ k1 = 0.04, k2 = 10000, k3 = 30000000 }}
a1 {{ {a1!r} }} a2 {{ {a2!r} }} a3 {{ {a3!r} }}
u_i {{ x = 1 / a1, y = 0, z = 0 }}
dudt_i {{ dxdt = 1, dydt = 0, dzdt = 0 }}
M_i {{ dxdt, dydt, 0 }}
F_i {{
  (-k1 * a1 * x + k2 * a2 * y * a3 * z) / a1,
  (k1 * a1 * x - k2 * a2 * y * a3 * z - k3 * a2 * y * a2 * y) / a2,
  1 - a1 * x - a2 * y - a3 * z,
}}
out_i {{ {out} }}
"""


def _robertson_only(prob: Problem) -> None:
    if prob.name != "robertson":
        raise NotImplementedError(f"the diffsol runners model Robertson only, not {prob.name}")


def _diffsol_ode(prob: Problem, out: str):
    import pydiffsol as ds

    a1, a2, a3 = (float(x) for x in prob.atol)
    ode = ds.Ode(ROBERTSON_DIFFSL.format(a1=a1, a2=a2, a3=a3, out=out),
                 matrix_type=ds.nalgebra_dense)
    ode.rtol, ode.atol = prob.rtol, 1.0
    return ode


def prepare_pydiffsol(prob: Problem) -> Prepared:
    """pydiffsol (diffsol BDF, dense LU, LLVM-compiled model) on the mass-matrix DAE
    M u' = F(u) in the scaled unknowns (see ROBERTSON_DIFFSL); ``solve_dense`` at the
    output times. No step count is reported (0)."""
    _robertson_only(prob)
    t = time.perf_counter()
    ode = _diffsol_ode(prob, "a1 * x, a2 * y, a3 * z")
    setup = time.perf_counter() - t
    ts = np.asarray(prob.ts)

    def run(args):
        return ode.solve_dense(np.asarray(args, float), ts)

    return Prepared("pydiffsol (BDF)", run, lambda out, args: (np.asarray(out.ys).T, 0), setup)


ROBERTSON_DIFFSL_UNSCALED = """
in_i { k1 = 0.04, k2 = 10000, k3 = 30000000 }
u_i { x = 1, y = 0, z = 0 }
dudt_i { dxdt = 1, dydt = 0, dzdt = 0 }
M_i { dxdt, dydt, 0 }
F_i { -k1 * x + k2 * y * z, k1 * x - k2 * y * z - k3 * y * y, 1 - x - y - z }
out_i { z }
"""


def prepare_pydiffsol_gradient(prob: Problem, adjoint_atol: float = 1e-8) -> Prepared:
    """pydiffsol's continuous adjoint of G = ∫_t0^t1 y3 dt (its output integrated):
    ``solve_continuous_adjoint`` -> (G, dG/dp), adjoint atol ``adjoint_atol`` and rtol
    the forward one. On the unscaled model with the scalar atol of y1 (1e-10; y2's
    1e-14 is not expressible): in the scaled unknowns pydiffsol 0.6.2's adjoint returned
    a wrong gradient (dG/dp1 1.5e11 against 1.49e6 from IDAS, daeadjoint and its own
    unscaled run)."""
    _robertson_only(prob)
    import pydiffsol as ds

    t = time.perf_counter()
    ode = ds.Ode(ROBERTSON_DIFFSL_UNSCALED, matrix_type=ds.nalgebra_dense)
    ode.rtol, ode.atol = prob.rtol, float(prob.atol[0])
    ode.sens_rtol, ode.sens_atol = prob.rtol, adjoint_atol
    setup = time.perf_counter() - t

    def run(args):
        return ode.solve_continuous_adjoint(np.asarray(args, float), prob.t1)

    return Prepared("pydiffsol adjoint", run,
                    lambda out, args: (np.ravel(np.asarray(out[1]))[None], 0), setup)


def diffsol_jax_solve(prob: Problem) -> tuple[Callable, float]:
    """(args -> ys (nt, n), build seconds): diffsol-jax on Robertson's ODE form
    (y3 = 1 − y1 − y2 eliminated) in the scaled unknowns, BDF, atol 1 (see above). The
    jnp right-hand side is translated to diffsol's DSL and compiled once here; each
    solve is one XLA custom call (CPU only), batched sequentially under ``jax.vmap``."""
    _robertson_only(prob)
    import diffsol_jax

    a = jnp.asarray(prob.atol)
    ts = jnp.asarray(prob.ts)

    def rhs(t, u, k):
        y1, y2 = a[0] * u[0], a[1] * u[1]
        y3 = 1.0 - y1 - y2
        return jnp.stack([(-k[0] * y1 + k[1] * y2 * y3) / a[0],
                          (k[0] * y1 - k[1] * y2 * y3 - k[2] * y2 * y2) / a[1]])

    t = time.perf_counter()
    ode = diffsol_jax.ODEProblem(rhs, jnp.asarray([1.0 / prob.atol[0], 0.0]),
                                 jnp.asarray(prob.args, dtype=jnp.float64))
    setup = time.perf_counter() - t

    def solve(args):
        u = ode.solve(args, ts, rtol=prob.rtol, atol=1.0)[1]
        y12 = u * a[:2]
        return jnp.concatenate([y12, 1.0 - jnp.sum(y12, axis=1, keepdims=True)], axis=1), 0

    return solve, setup


# --------------------------------------------------------------------------- sundials4py
# SUNDIALS' official Python bindings (IDAS 7.9; Python >= 3.12 only, so imported where
# used). The model is Python callbacks on numpy views of the N_Vectors, as a user of the
# bindings writes it, with the exact dense Jacobian (as SUNDIALS' idasRoberts_dns):
#     F1 = y1' + a,  F2 = y2' - a + p3 y2^2,  F3 = y1 + y2 + y3 - 1,  a = p1 y1 - p2 y2 y3.
# IDAS's per-component atol and rtol as every other peer.
class _Sundials4pyRobertson:
    """One IDAS memory per call (built in microseconds), callbacks closed over ``p``."""

    def __init__(self, prob: Problem):
        _robertson_only(prob)
        import sundials4py.core as core
        import sundials4py.idas as idas

        self.core, self.idas, self.prob = core, idas, prob
        self.ctx = core.SUNContext_Create(0)[1]

    def vector(self, values):
        v = self.core.N_VNew_Serial(len(values), self.ctx)
        self.core.N_VGetArrayPointer(v)[:] = values
        return v

    def callbacks(self, p):
        arr, data = self.core.N_VGetArrayPointer, self.core.SUNDenseMatrix_Data
        p1, p2, p3 = (float(x) for x in p)

        def res(t, yv, ypv, rv, _):
            y, yp, r = arr(yv), arr(ypv), arr(rv)
            a = p1 * y[0] - p2 * y[1] * y[2]
            r[0] = yp[0] + a
            r[1] = yp[1] - a + p3 * y[1] * y[1]
            r[2] = y[0] + y[1] + y[2] - 1.0
            return 0

        def jac(t, cj, yv, ypv, rv, J, _, t1, t2, t3):  # dF/dy + cj dF/dy'
            y, A = arr(yv), data(J)
            A[0, 0], A[0, 1], A[0, 2] = p1 + cj, -p2 * y[2], -p2 * y[1]
            A[1, 0], A[1, 1], A[1, 2] = -p1, p2 * y[2] + 2 * p3 * y[1] + cj, p2 * y[1]
            A[2, 0] = A[2, 1] = A[2, 2] = 1.0
            return 0

        return res, jac

    def forward(self, p):
        """An IDAS memory initialised at t0 with the consistent (y0, y0'), exact Jacobian."""
        prob, idas, core = self.prob, self.idas, self.core
        res, jac = self.callbacks(p)
        y, yp = self.vector(prob.y0), self.vector(prob.yp0(p))
        view = idas.IDACreate(self.ctx)
        mem = view.get()
        idas.IDAInit(mem, res, prob.t0, y, yp)
        atol = self.vector(prob.atol)
        idas.IDASVtolerances(mem, prob.rtol, atol)
        A = core.SUNDenseMatrix(3, 3, self.ctx)
        ls = core.SUNLinSol_Dense(y, A, self.ctx)
        idas.IDASetLinearSolver(mem, ls, A)
        idas.IDASetJacFn(mem, jac)
        idas.IDASetMaxNumSteps(mem, MAX_STEPS)
        # The callbacks, vectors and solver objects must outlive the solve.
        return mem, y, yp, (view, res, jac, atol, A, ls)


def prepare_sundials4py(prob: Problem) -> Prepared:
    """IDAS through sundials4py: dense LU, exact Jacobian, Python residual; outputs at
    ``prob.ts`` by IDA_NORMAL calls (IDAS's interpolation)."""
    s = _Sundials4pyRobertson(prob)
    idas, arr = s.idas, s.core.N_VGetArrayPointer

    def run(args):
        mem, y, yp, _keep = s.forward(np.asarray(args, float))
        ys = []
        for tout in prob.ts:
            flag, _ = idas.IDASolve(mem, float(tout), y, yp, idas.IDA_NORMAL)
            if flag < 0:
                raise RuntimeError(f"sundials4py IDASolve failed: {idas.IDAGetReturnFlagName(flag)}")
            ys.append(arr(y).copy())
        return np.array(ys), idas.IDAGetNumSteps(mem)[1]

    return Prepared("IDAS (sundials4py)", run, lambda out, args: out)


def prepare_sundials4py_gradient(prob: Problem, adjoint_atol: float = 1e-8) -> Prepared:
    """IDAS's adjoint (IDASolveF / IDASolveB, Hermite checkpoints every 100 steps) of
    G = ∫_t0^t1 y3 dt -> (G, dG/dp), adjoint rtol the forward one and atol
    ``adjoint_atol`` for λ and the quadratures (as daeadjoint's ``Adjoint(atol=...)``).

    The adjoint DAE of F(t, y, y', p) = 0 with G = ∫ g dt (g = y3) is
    (F_y'ᵀλ)' − F_yᵀλ + g_yᵀ = 0, F_y'ᵀλ(T) = 0, and dG/dp = −∫ λᵀF_p dt; with
    F_y' = diag(1, 1, 0) and l21 = λ2 − λ1 it reads
    λ1' + p1 l21 − λ3 = 0, λ2' − p2 y3 l21 − 2 p3 y2 λ2 − λ3 = 0, 1 − p2 y2 l21 − λ3 = 0,
    λ(T) = (0, 0, 1), λ'(T) = (1, 1, 0) (SUNDIALS' idasRoberts_ASAi_dns); the backward
    quadrature qB' = −λᵀF_p integrated from T to t0 gives qB(t0) = −dG/dp."""
    s = _Sundials4pyRobertson(prob)
    idas, core, arr, data = s.idas, s.core, s.core.N_VGetArrayPointer, s.core.SUNDenseMatrix_Data

    def run(args):
        p = np.asarray(args, float)
        p1, p2, p3 = (float(x) for x in p)

        def rhs_q(t, yv, ypv, qv, _):
            arr(qv)[0] = arr(yv)[2]
            return 0

        def res_b(t, yv, ypv, lv, lpv, rv, _):
            y, lam, lp, r = arr(yv), arr(lv), arr(lpv), arr(rv)
            l21 = lam[1] - lam[0]
            r[0] = lp[0] + p1 * l21 - lam[2]
            r[1] = lp[1] - p2 * y[2] * l21 - 2.0 * p3 * y[1] * lam[1] - lam[2]
            r[2] = 1.0 - p2 * y[1] * l21 - lam[2]
            return 0

        def jac_b(t, cj, yv, ypv, lv, lpv, rv, J, _, t1, t2, t3):  # d rB/dλ + cj d rB/dλ'
            y, A = arr(yv), data(J)
            A[0, 0], A[0, 1], A[0, 2] = cj - p1, p1, -1.0
            A[1, 0], A[1, 1], A[1, 2] = p2 * y[2], cj - p2 * y[2] - 2.0 * p3 * y[1], -1.0
            A[2, 0], A[2, 1], A[2, 2] = p2 * y[1], -p2 * y[1], -1.0
            return 0

        def rhs_qb(t, yv, ypv, lv, lpv, qv, _):  # −λᵀF_p... integrated backward (above)
            y, lam, q = arr(yv), arr(lv), arr(qv)
            l21 = lam[1] - lam[0]
            q[0], q[1], q[2] = y[0] * l21, -y[2] * y[1] * l21, -y[1] * y[1] * lam[1]
            return 0

        mem, y, yp, _keep = s.forward(p)
        q = s.vector([0.0])
        idas.IDAQuadInit(mem, rhs_q, q)
        idas.IDAAdjInit(mem, 100, idas.IDA_HERMITE)
        flag = idas.IDASolveF(mem, float(prob.t1), y, yp, idas.IDA_NORMAL)[0]
        if flag < 0:
            raise RuntimeError(f"sundials4py IDASolveF failed: {idas.IDAGetReturnFlagName(flag)}")
        idas.IDAGetQuad(mem, q)
        which = idas.IDACreateB(mem)[1]
        yb, ypb, qb = s.vector([0.0, 0.0, 1.0]), s.vector([1.0, 1.0, 0.0]), s.vector([0.0] * 3)
        idas.IDAInitB(mem, which, res_b, float(prob.t1), yb, ypb)
        atol_b = s.vector([adjoint_atol] * 3)
        idas.IDASVtolerancesB(mem, which, prob.rtol, atol_b)
        A = core.SUNDenseMatrix(3, 3, s.ctx)
        ls = core.SUNLinSol_Dense(yb, A, s.ctx)
        idas.IDASetLinearSolverB(mem, which, ls, A)
        idas.IDASetJacFnB(mem, which, jac_b)
        idas.IDASetMaxNumStepsB(mem, which, MAX_STEPS)
        idas.IDAQuadInitB(mem, which, rhs_qb, qb)
        idas.IDAQuadSStolerancesB(mem, which, prob.rtol, adjoint_atol)
        idas.IDASetQuadErrConB(mem, which, 1)
        flag = idas.IDASolveB(mem, float(prob.t0), idas.IDA_NORMAL)
        if flag < 0:
            raise RuntimeError(f"sundials4py IDASolveB failed: {idas.IDAGetReturnFlagName(flag)}")
        idas.IDAGetB(mem, which, yb, ypb)
        idas.IDAGetQuadB(mem, which, qb)
        return arr(q)[0], -arr(qb).copy()

    return Prepared("IDAS adjoint (sundials4py)", run,
                    lambda out, args: (np.asarray(out[1])[None], 0))


def prepare_sundials4py_fsa(prob: Problem) -> Prepared:
    """IDAS's forward sensitivities (simultaneous corrector, exact sensitivity residual
    F_y s + F_y' s' + F_p, sensitivities in the error test with the states' atol) ->
    d y(t1)/dp, shape (3 parameters, 3 components). s(t0) = 0 (y0 does not depend on
    p) and s'(t0) = d y'(t0)/dp = (−1, 1, 0), (0, 0, 0), (0, 0, 0) from y'0 = (−p1, p1, 0)."""
    s = _Sundials4pyRobertson(prob)
    idas, arr = s.idas, s.core.N_VGetArrayPointer

    def run(args):
        p = np.asarray(args, float)
        p1, p2, p3 = (float(x) for x in p)

        def res_s(ns, t, yv, ypv, rv, ysv, ypsv, rsv, _, t1, t2, t3):
            y = arr(yv)
            for i in range(3):
                sv, spv, r = arr(ysv[i]), arr(ypsv[i]), arr(rsv[i])
                da = p1 * sv[0] - p2 * (sv[1] * y[2] + y[1] * sv[2])
                da += (y[0], -y[1] * y[2], 0.0)[i]  # ∂a/∂p_i
                r[0] = spv[0] + da
                r[1] = spv[1] - da + 2.0 * p3 * y[1] * sv[1] + (0.0, 0.0, y[1] * y[1])[i]
                r[2] = sv[0] + sv[1] + sv[2]
            return 0

        mem, y, yp, _keep = s.forward(p)
        ys0 = [s.vector([0.0] * 3) for _ in range(3)]
        yps0 = [s.vector([-1.0, 1.0, 0.0]), s.vector([0.0] * 3), s.vector([0.0] * 3)]
        idas.IDASensInit(mem, 3, idas.IDA_SIMULTANEOUS, res_s, ys0, yps0)
        atol_s = [s.vector(prob.atol) for _ in range(3)]
        idas.IDASensSVtolerances(mem, prob.rtol, atol_s)
        idas.IDASetSensErrCon(mem, 1)
        flag = idas.IDASolve(mem, float(prob.t1), y, yp, idas.IDA_NORMAL)[0]
        if flag < 0:
            raise RuntimeError(f"sundials4py IDASolve (FSA) failed: {idas.IDAGetReturnFlagName(flag)}")
        idas.IDAGetSens(mem, ys0)
        return np.stack([arr(v).copy() for v in ys0])

    return Prepared("IDAS FSA (sundials4py)", run, lambda out, args: (np.asarray(out), 0))
