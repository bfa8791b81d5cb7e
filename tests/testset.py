"""Problems of the *Test Set for IVP Solvers* (Mazzia & Magherini, University of Bari;
earlier Lioen & de Swart, CWI) as JAX residuals with their published reference solutions.

Each problem is a `Problem`: `residual(t, y, yp, p)` with the physical parameters in the
dict `p` (so `jax.grad` with respect to them makes sense), the nominal `p`, the interval,
consistent initial values (`initial(p)` recomputes them for other parameters), the
reference solution at `t1`, the known input breakpoints and the Test Set's accuracy
measures (`scd`, `mescd`).

Everything is float64 and pure `jax.numpy`: the piecewise device models and input pulses
are `jnp.where` chains whose unused branches are evaluated at safe arguments, so that
neither the values nor the derivatives of the branch taken are polluted by NaN. Where the
Test Set's own code reports an evaluation error (its residual's error flag), the residual
here returns NaN, which the solver treats as a failed residual evaluation and retries with
a smaller step.

Accuracy measures, as the Test Set's drivers compute them at t1:

- `scd` ("significant correct digits"): −log10 of the largest relative error
  |y_i − yref_i| / |yref_i| over the components the Test Set scores (all, except for the
  NAND gate: only y5; the two-bit adder: only the three output nodes; see `scored`), with
  components whose reference is below 1e-200 in magnitude left out.
- `mescd` ("mixed error significant correct digits"): −log10 of the largest
  |y_i − yref_i| / (atol_i/rtol_i + |yref_i|) over **all** components.

A zero error counts as 1e-16 (16 digits), as in the Test Set.

The index-2 problems (`INDEX2_PROBLEMS`: water tube, Fekete, slider crank) declare their
index-2 variables and constraints in `index2` and are solved with `solve(index2=...)`
(tests/test_index2.py). The slider crank is given twice: in the Test Set's form (n = 24,
with the accelerations as variables) and with the accelerations eliminated (n = 17,
`crank_reduced`); see there why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Problem", "scd", "mescd", "pulse", "transistor", "transistor_semi_explicit",
           "nand", "akzo", "twobit", "PROBLEMS", "tube", "fekete", "crank", "crank_reduced",
           "INDEX2_PROBLEMS"]


# ------------------------------------------------------------------------ accuracy


def scd(y, yref, scored=None) -> float:
    """The Test Set's significant correct digits: −log10 max_i |y_i − yref_i|/|yref_i|
    over the components `scored` (default all) with |yref_i| ≥ 1e-200."""
    y, yref = np.asarray(y, float), np.asarray(yref, float)
    idx = np.arange(y.shape[-1]) if scored is None else np.asarray(scored)
    y, yref = y[..., idx], yref[idx]
    keep = np.abs(yref) >= 1e-200
    err = np.max(np.abs(y[..., keep] - yref[keep]) / np.abs(yref[keep]), axis=-1)
    return float(-np.log10(np.where(err == 0.0, 1e-16, err)))


def mescd(y, yref, rtol, atol) -> float:
    """The Test Set's mixed-error significant correct digits: −log10 max_i |y_i − yref_i|
    / (atol_i/rtol_i + |yref_i|) over all components (rtol, atol scalars or per
    component)."""
    y, yref = np.asarray(y, float), np.asarray(yref, float)
    err = np.max(np.abs(y - yref) / (np.asarray(atol) / np.asarray(rtol) + np.abs(yref)),
                 axis=-1)
    return float(-np.log10(np.where(err == 0.0, 1e-16, err)))


# ------------------------------------------------------------------------ problem


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """One Test Set problem.

    - `residual(t, y, yp, p)`: F(t, y, y', p) = 0, p a dict of floats.
    - `p`: the nominal parameters (Python floats; `jnp` arrays work as well).
    - `initial(p) -> (y0, yp0)`: consistent initial values for the parameters p
      (differentiable in p); `y0`, `yp0` are those at the nominal p.
    - `algebraic`: the mask of components absent from y' (None: every component
      enters through y', as in a non-diagonal singular mass matrix).
    - `index2`: the mask of the index-2 variables, which is also the mask of the
      index-2 constraint equations (`solve(index2=...)`); None for index ≤ 1.
    - `yref`: the Test Set's reference solution at `t1` (None for index-2 problems whose
      solution the solver cannot reproduce is still given).
    - `scored`: 0-based components the Test Set's `scd` uses (None: all).
    - `breakpoints`: times in (t0, t1) where the inputs have kinks (the Test Set's drivers
      restart the integration there).
    - `rtol`, `atol`: the tolerance the Test Set's published runs of this problem start
      from (its drivers take one scalar tolerance for both); `h0`: their initial step as a
      function of rtol, where the sources fix one.
    - `output`: the component(s) the Test Set plots as the output of the model (0-based).
    - `to_testset`: maps the solver's y to the Test Set's variables (identity unless the
      problem is a reformulation); `yref`, `scd` and `mescd` are in the Test Set's
      variables.
    """

    name: str
    residual: Callable
    p: dict
    initial: Callable
    t0: float
    t1: float
    yref: np.ndarray | None
    index: int
    algebraic: np.ndarray | None = None
    index2: np.ndarray | None = None
    scored: np.ndarray | None = None
    breakpoints: tuple = ()
    rtol: float = 1e-6
    atol: float = 1e-6
    h0: Callable | None = None
    output: tuple = ()
    to_testset: Callable | None = None

    @property
    def n(self) -> int:
        return int(np.asarray(self.y0).shape[0])

    @property
    def y0(self):
        return self.initial(self.p)[0]

    @property
    def yp0(self):
        return self.initial(self.p)[1]

    def params(self, **overrides) -> dict:
        """The nominal parameters as float64 arrays, with `overrides` replacing entries."""
        out = {k: jnp.asarray(v, jnp.float64) for k, v in self.p.items()}
        out.update({k: jnp.asarray(v, jnp.float64) for k, v in overrides.items()})
        return out

    def testset_values(self, y) -> np.ndarray:
        """y (the solver's variables) in the Test Set's variables."""
        y = np.asarray(y, float)
        return y if self.to_testset is None else np.asarray(self.to_testset(y), float)

    def scd(self, y, yref=None) -> float:
        """`scd` of the solver's y against `yref` (default: the Test Set's reference)."""
        return scd(self.testset_values(y), self.yref if yref is None else yref, self.scored)

    def mescd(self, y, rtol, atol, yref=None) -> float:
        """`mescd` of the solver's y (atol/rtol as given to the solver)."""
        return mescd(self.testset_values(y), self.yref if yref is None else yref, rtol, atol)


# ------------------------------------------------------------------------ shared pieces


def pulse(t, low, high, delay, t_rise, t_high, t_fall, period):
    """The Test Set's periodic trapezoidal input and its time derivative at t ≥ 0:
    `low` until `delay`, linear rise over `t_rise`, `high` for `t_high`, linear fall over
    `t_fall`, `low` until the end of the `period`. At a corner the value of the earlier
    piece is taken (the intervals are open on the left), as in the Test Set."""
    s = jnp.mod(t, period)
    a, b, c = delay + t_rise, delay + t_rise + t_high, delay + t_rise + t_high + t_fall
    rise, fall = (high - low) / t_rise, (high - low) / t_fall
    v = jnp.where(s > c, low,
        jnp.where(s > b, fall * (c - s) + low,
        jnp.where(s > a, high,
        jnp.where(s > delay, rise * (s - delay) + low, low))))
    vd = jnp.where(s > c, 0.0,
         jnp.where(s > b, -fall,
         jnp.where(s > a, 0.0,
         jnp.where(s > delay, rise, 0.0))))
    return v, vd


def _pulse_corners(t1, delay, t_rise, t_high, t_fall, period):
    """The kinks of `pulse` in (0, t1)."""
    offsets = np.cumsum([delay, t_rise, t_high, t_fall])
    out = {float(k * period + o) for k in range(int(t1 // period) + 1) for o in offsets}
    return {x for x in out if 0.0 < x < t1}


def _junction_current(v, curis, vth):
    """Shichman–Hodges pn-junction current: −I_s (exp(v/V_T) − 1) for v ≤ 0, else 0."""
    return jnp.where(v <= 0.0, -curis * (jnp.exp(jnp.minimum(v, 0.0) / vth) - 1.0), 0.0)


def _junction_capacitance(v, c0, phib):
    """Voltage-dependent bulk capacitance: c0/√(1 − v/φ_B) for v ≤ 0, c0 (1 + v/(2φ_B))
    above."""
    return jnp.where(v <= 0.0, c0 / jnp.sqrt(1.0 - jnp.minimum(v, 0.0) / phib),
                     c0 * (1.0 + v / (2.0 * phib)))


def _drain_current(vds, vgs, vbs, vgd, vbd, vt0, gamma, phi, beta_p, beta_m, delta):
    """Shichman–Hodges drain current (source → drain sign convention of the Test Set).

    For vds > 0 it depends on (vgs, vbs) with gain `beta_p`, for vds < 0 on (vgd, vbd)
    with gain `beta_m`; zero at vds = 0. The threshold vte = vt0 + γ(√(φ − v_b) − √φ)
    needs v_b ≤ φ (v_b = vbs or vbd, whichever branch is taken): outside it the Test Set
    flags an evaluation error, here the current is NaN."""
    def branch(v_ds, v_g, v_b, beta, sign):
        ok = phi - v_b >= 0.0
        vte = vt0 + gamma * (jnp.sqrt(jnp.maximum(phi - v_b, 0.0)) - jnp.sqrt(phi))
        ov = v_g - vte                         # overdrive
        ad = sign * v_ds                       # |vds| on this branch
        sat = sign * -beta * ov ** 2 * (1.0 + sign * delta * v_ds)
        lin = -beta * v_ds * (2.0 * ov - ad) * (1.0 + sign * delta * v_ds)
        cur = jnp.where(ov <= 0.0, 0.0, jnp.where(ov <= ad, sat, jnp.where(ad > 0.0, lin, 0.0)))
        return jnp.where(ok, cur, jnp.nan)

    pos = branch(vds, vgs, vbs, beta_p, 1.0)
    neg = branch(vds, vgd, vbd, beta_m, -1.0)
    return jnp.where(vds > 0.0, pos, jnp.where(vds < 0.0, neg, 0.0))


# ------------------------------------------------------------------- transistor amplifier
# Index-1 DAE M y' = f(t, y), n = 8, t ∈ [0, 0.2]: a two-stage amplifier with
# bipolar transistors; M is singular and not diagonal (three 2×2 blocks C_k [[-1, 1],
# [1, -1]] and two diagonal entries). No component is absent from y': the three
# algebraic constraints are the sums of the rows of each 2×2 block.

TRANSISTOR_P = dict(ub=6.0, uf=0.026, alpha=0.99, beta=1e-6,
                    r0=1000.0, r1=9000.0, r2=9000.0, r3=9000.0, r4=9000.0, r5=9000.0,
                    r6=9000.0, r7=9000.0, r8=9000.0, r9=9000.0,
                    c1=1e-6, c2=2e-6, c3=3e-6, c4=4e-6, c5=5e-6)

# The Test Set's reference y(0.2) (computed with PSIDE at tolerance 1e-14).
TRANSISTOR_YREF = np.array([
    -0.5562145012262709e-02, 0.3006522471903042e+01, 0.2849958788608128e+01,
    0.2926422536206241e+01, 0.2704617865010554e+01, 0.2761837778393145e+01,
    0.4770927631616772e+01, 0.1236995868091548e+01])

# The published y'(0) (the hidden-constraint values, 8 digits); `transistor_initial`
# reproduces them to these digits.
TRANSISTOR_YP0_PUBLISHED = np.array([51.338775, 51.338775, -3.0 / (2e-6 * 9000.0),
                                     -24.9757667, -24.9757667, -3.0 / (4e-6 * 9000.0),
                                     -10.00564453, -10.00564453])


def _transistor_f(t, y, p):
    ue = 0.1 * jnp.sin(200.0 * math.pi * t)
    g23 = p["beta"] * (jnp.exp((y[1] - y[2]) / p["uf"]) - 1.0)
    g56 = p["beta"] * (jnp.exp((y[4] - y[5]) / p["uf"]) - 1.0)
    a, ub = p["alpha"], p["ub"]
    return jnp.stack([
        (y[0] - ue) / p["r0"],
        y[1] / p["r1"] + (y[1] - ub) / p["r2"] + (1.0 - a) * g23,
        y[2] / p["r3"] - g23,
        (y[3] - ub) / p["r4"] + a * g23,
        y[4] / p["r5"] + (y[4] - ub) / p["r6"] + (1.0 - a) * g56,
        y[5] / p["r7"] - g56,
        (y[6] - ub) / p["r8"] + a * g56,
        y[7] / p["r9"],
    ])


def _transistor_my(yp, p):
    c1, c2, c3, c4, c5 = p["c1"], p["c2"], p["c3"], p["c4"], p["c5"]
    return jnp.stack([
        -c1 * yp[0] + c1 * yp[1], c1 * yp[0] - c1 * yp[1], -c2 * yp[2],
        -c3 * yp[3] + c3 * yp[4], c3 * yp[3] - c3 * yp[4], -c4 * yp[5],
        -c5 * yp[6] + c5 * yp[7], c5 * yp[6] - c5 * yp[7],
    ])


def transistor_residual(t, y, yp, p):
    """Transistor amplifier: M y' − f(t, y) with U_e(t) = 0.1 sin(200πt) and the
    transistor currents β(exp((U_2 − U_3)/U_F) − 1), β(exp((U_5 − U_6)/U_F) − 1). The
    exponentials overflow to inf for voltage differences above ~18 V (a failed
    evaluation for the solver, as in the Test Set's code, which has no error flag)."""
    return _transistor_my(yp, p) - _transistor_f(t, y, p)


# Left null vectors of M: the three algebraic constraints are these sums of rows.
_TRANSISTOR_CONSTRAINTS = np.array([[1, 1, 0, 0, 0, 0, 0, 0],
                                    [0, 0, 0, 1, 1, 0, 0, 0],
                                    [0, 0, 0, 0, 0, 0, 1, 1]], float)


def transistor_initial(p):
    """Consistent (y0, y'0) at t = 0 for parameters p. y0 is the Test Set's operating
    point (y2 = y3 = U_b/(R2/R1 + 1), y5 = y6 = U_b/(R6/R5 + 1), y4 = y7 = U_b, y1 = y8 =
    0), consistent for every p; y'0 solves M y' = f together with the time derivative of
    the three constraints N f(t, y) = 0 (N the left null vectors of M), which is how the
    published y'(0) are obtained."""
    p = {k: jnp.asarray(v, jnp.float64) for k, v in p.items()}
    ub = p["ub"]
    u2 = ub / (p["r2"] / p["r1"] + 1.0)
    u5 = ub / (p["r6"] / p["r5"] + 1.0)
    zero = jnp.zeros_like(ub)
    y0 = jnp.stack([zero, u2, u2, ub, u5, u5, ub, zero])
    t0 = jnp.asarray(0.0)
    N = jnp.asarray(_TRANSISTOR_CONSTRAINTS)
    f = _transistor_f(t0, y0, p)
    M = jax.jacfwd(lambda v: _transistor_my(v, p))(jnp.zeros(8))
    g = lambda t, y: N @ _transistor_f(t, y, p)
    g_y = jax.jacfwd(g, argnums=1)(t0, y0)
    g_t = jax.jacfwd(g, argnums=0)(t0, y0)
    # M has rank 5: rows 2, 5, 8 are minus rows 1, 4, 7. Keep one row of each pair
    # and the three differentiated constraints g_y y' = −g_t: a nonsingular 8×8 system.
    keep = np.array([0, 2, 3, 5, 6])
    yp0 = jnp.linalg.solve(jnp.concatenate([M[keep], g_y]), jnp.concatenate([f[keep], -g_t]))
    return y0, yp0


transistor = Problem(
    name="transistor", residual=transistor_residual, p=TRANSISTOR_P,
    initial=transistor_initial, t0=0.0, t1=0.2, yref=TRANSISTOR_YREF, index=1,
    rtol=1e-6, atol=1e-6, output=(7,))


# The same circuit in semi-explicit form, by the change of variables z = T y with
# z1 = y1 − y2, z4 = y4 − y5, z7 = y7 − y8 (the capacitor voltages) and the other
# components unchanged: F(t, T⁻¹z, T⁻¹z', p) no longer depends on z2', z5', z8', which
# are therefore algebraic (the node voltages U2, U5, U8). The solution is the same
# (y = T⁻¹z); the solver's error test, forward sensitivities and continuous adjoint
# treat the two forms differently (see tests/test_testset.py).
TRANSISTOR_T = np.eye(8)
TRANSISTOR_T[[0, 3, 6], [1, 4, 7]] = -1.0
_TRANSISTOR_TINV = np.linalg.inv(TRANSISTOR_T)


def transistor_semi_explicit_residual(t, z, zp, p):
    """The transistor amplifier's residual in z = T y."""
    Ti = jnp.asarray(_TRANSISTOR_TINV)
    return transistor_residual(t, Ti @ z, Ti @ zp, p)


def transistor_semi_explicit_initial(p):
    y0, yp0 = transistor_initial(p)
    T = jnp.asarray(TRANSISTOR_T)
    return T @ y0, T @ yp0


transistor_semi_explicit = Problem(
    name="transistor_semi_explicit", residual=transistor_semi_explicit_residual,
    p=TRANSISTOR_P, initial=transistor_semi_explicit_initial, t0=0.0, t1=0.2,
    yref=TRANSISTOR_YREF, index=1,
    algebraic=np.array([False, True, False, False, True, False, False, True]),
    rtol=1e-6, atol=1e-6, output=(7,), to_testset=lambda z: _TRANSISTOR_TINV @ z)

# ------------------------------------------------------------------------- NAND gate
# Index-0 implicit DAE C(y) y' = f(t, y), n = 14, t ∈ [0, 80]: a CMOS NAND gate with
# four MOSFETs (Shichman–Hodges model), a state-dependent capacitance matrix and two
# trapezoidal input pulses whose derivatives enter f.

NAND_P = dict(
    RGS=4.0, RGD=4.0, RBS=10.0, RBD=10.0, CGS=0.6e-4, CGD=0.6e-4, CBD=2.4e-5,
    C9=0.5e-4, DELTA=0.2e-1, CURIS=1e-14, VTH=25.85, VDD=5.0, VBB=-2.5,
    PHIB=0.87,
    # depletion-type MOSFET (the load)
    VT0_dep=-2.43, GAMMA_dep=0.2, PHI_dep=1.28, BETA_dep=5.35e-4,
    # enhancement-type MOSFETs (the two inputs). The Test Set uses a tenth of the gain
    # for negative drain-source voltage; kept, since its reference solution is computed
    # with it.
    VT0_enh=0.2, GAMMA_enh=0.035, PHI_enh=1.01, BETA_enh=1.748e-3, BETA_enh_rev=1.748e-4,
)

# The Test Set's reference y(80) (computed with PSIDE at tolerance 1e-16).
NAND_YREF = np.array([
    0.4971088699385777e+1, 0.4999752103929311e+1, -0.2499998781491227e+1,
    -0.2499999999999975e+1, 0.4970837023296724e+1, -0.2091214032073855e+0,
    0.4970593243278363e+1, -0.2500077409198803e+1, -0.2499998781491227e+1,
    -0.2090289583878100e+0, -0.2399999999966269e-3, -0.2091214032073855e+0,
    -0.2499999999999991e+1, -0.2500077409198803e+1])

# Not from the Test Set: y(10) (the end of V1's rise, a kink) and y(15) (the start of its
# fall), computed with this package at rtol = atol = 1e-11, restarted at every kink with
# y' recomputed from the right-hand input derivative (benchmarks/testset.py,
# `segmented_reference`; the same procedure reproduces the published y(80) to 11.9
# significant digits of y5, and agrees with itself at rtol 1e-10 to 13 digits).
NAND_YREF_AT = {
    10.0: np.array([
        5.0272184391789940e+00, 5.0002400000000184e+00, -2.4999999999997966e+00,
        -2.4999999999999223e+00, 5.0274584391788357e+00, 5.2364378782930805e+00,
        5.0276984391790025e+00, -2.4999752866938731e+00, -2.5000000000000169e+00,
        5.2362756062922049e+00, 0.0, 5.2361978782931962e+00, -2.4999999999999956e+00,
        -2.4999752866939113e+00]),
    15.0: np.array([
        4.9999999999976970e+00, 4.9999999999999796e+00, -2.4999999999999747e+00,
        -2.4999999999999747e+00, 4.9999999999976774e+00, 5.2363009513269017e+00,
        4.9999999999976774e+00, -2.4999999999999765e+00, -2.4999999999999747e+00,
        5.2363009513268954e+00, 0.0, 5.2363009513269025e+00, -2.4999999999999907e+00,
        -2.4999999999999765e+00]),
}

# The inputs: V1 (delay 5, rise 5, high 5, fall 5, period 20) and V2 (delay 15, rise 5,
# high 15, fall 5, period 40), both between 0 and 5 V.
NAND_V1 = (0.0, 5.0, 5.0, 5.0, 5.0, 5.0, 20.0)
NAND_V2 = (0.0, 5.0, 15.0, 5.0, 15.0, 5.0, 40.0)


def nand_inputs(t):
    """(V1, V1', V2, V2') at time t."""
    v1, v1d = pulse(t, *NAND_V1)
    v2, v2d = pulse(t, *NAND_V2)
    return v1, v1d, v2, v2d


def _nand_capacitance(y, p):
    """The 14×14 capacitance matrix C(y)."""
    cap = lambda v: _junction_capacitance(v, p["CBD"], p["PHIB"])
    cgs, cgd, c9 = p["CGS"], p["CGD"], p["C9"]
    c35, c4, c95 = cap(y[2] - y[4]), cap(y[3] - p["VDD"]), cap(y[8] - y[4])
    c810, c1410, c13 = cap(y[7] - y[9]), cap(y[13] - y[9]), cap(y[12])
    C = jnp.zeros((14, 14), jnp.result_type(y, float))
    entries = [
        (0, 0, cgs), (0, 4, -cgs), (1, 1, cgd), (1, 4, -cgd),
        (2, 2, c35), (2, 4, -c35), (3, 3, c4),
        (4, 0, -cgs), (4, 1, -cgd), (4, 2, -c35), (4, 4, cgs + cgd + c35 + c95 + c9),
        (4, 8, -c95),
        (5, 5, cgs), (6, 6, cgd), (7, 7, c810), (7, 9, -c810),
        (8, 4, -c95), (8, 8, c95),
        (9, 7, -c810), (9, 9, c810 + c1410 + c9), (9, 13, -c1410),
        (10, 10, cgs), (11, 11, cgd), (12, 12, c13),
        (13, 9, -c1410), (13, 13, c1410),
    ]
    rows, cols, vals = zip(*entries)
    return C.at[np.array(rows), np.array(cols)].set(jnp.stack(vals))


def _nand_f(t, y, p):
    """The static currents f(t, y)."""
    v1, v1d, v2, v2d = nand_inputs(t)
    ibs = lambda v: _junction_current(v, p["CURIS"], p["VTH"])
    dep = lambda *v: _drain_current(*v, p["VT0_dep"], p["GAMMA_dep"], p["PHI_dep"],
                                    p["BETA_dep"], p["BETA_dep"], p["DELTA"])
    enh = lambda *v: _drain_current(*v, p["VT0_enh"], p["GAMMA_enh"], p["PHI_enh"],
                                    p["BETA_enh"], p["BETA_enh_rev"], p["DELTA"])
    RGS, RGD, RBS, RBD = p["RGS"], p["RGD"], p["RBS"], p["RBD"]
    CGS, CGD, VDD, VBB = p["CGS"], p["CGD"], p["VDD"], p["VBB"]
    Y = lambda k: y[k - 1]                         # the Test Set's 1-based node numbers
    i1 = dep(Y(2) - Y(1), Y(5) - Y(1), Y(3) - Y(5), Y(5) - Y(2), Y(4) - VDD)
    i2 = enh(Y(7) - Y(6), v1 - Y(6), Y(8) - Y(10), v1 - Y(7), Y(9) - Y(5))
    i3 = enh(Y(12) - Y(11), v2 - Y(11), Y(13), v2 - Y(12), Y(14) - Y(10))
    return jnp.stack([
        -(Y(1) - Y(5)) / RGS - i1,
        -(Y(2) - VDD) / RGD + i1,
        -(Y(3) - VBB) / RBS + ibs(Y(3) - Y(5)),
        -(Y(4) - VBB) / RBD + ibs(Y(4) - VDD),
        -(Y(5) - Y(1)) / RGS - ibs(Y(3) - Y(5)) - (Y(5) - Y(7)) / RGD - ibs(Y(9) - Y(5)),
        CGS * v1d - (Y(6) - Y(10)) / RGS - i2,
        CGD * v1d - (Y(7) - Y(5)) / RGD + i2,
        -(Y(8) - VBB) / RBS + ibs(Y(8) - Y(10)),
        -(Y(9) - VBB) / RBD + ibs(Y(9) - Y(5)),
        -(Y(10) - Y(6)) / RGS - ibs(Y(8) - Y(10)) - (Y(10) - Y(12)) / RGD
        - ibs(Y(14) - Y(10)),
        CGS * v2d - Y(11) / RGS - i3,
        CGD * v2d - (Y(12) - Y(10)) / RGD + i3,
        -(Y(13) - VBB) / RBS + ibs(Y(13)),
        -(Y(14) - VBB) / RBD + ibs(Y(14) - Y(10)),
    ])


def nand_residual(t, y, yp, p):
    """NAND gate: C(y) y' − f(t, y). NaN where a MOSFET's bulk voltage exceeds φ (the
    Test Set's evaluation error)."""
    return _nand_capacitance(y, p) @ yp - _nand_f(t, y, p)


def nand_initial(p):
    """(y0, y'0): the Test Set's y0 (a DC operating point to 5 digits, the bulk nodes at
    V_BB) and the consistent y'0 = C(y0)⁻¹ f(0, y0) of the index-0 system. (The Test
    Set passes y'0 = 0; the two differ by at most ~4e-9.)"""
    p = {k: jnp.asarray(v, jnp.float64) for k, v in p.items()}
    vbb = p["VBB"]
    c = lambda x: jnp.asarray(x, jnp.float64) + 0.0 * vbb
    y0 = jnp.stack([c(5.0), c(5.0), vbb, vbb, c(5.0), c(3.62385), c(5.0), vbb, vbb,
                    c(3.62385), c(0.0), c(3.62385), vbb, vbb])
    yp0 = jnp.linalg.solve(_nand_capacitance(y0, p), _nand_f(jnp.asarray(0.0), y0, p))
    return y0, yp0


nand = Problem(
    name="nand", residual=nand_residual, p=NAND_P, initial=nand_initial, t0=0.0,
    t1=80.0, yref=NAND_YREF, index=0, scored=np.array([4]),
    breakpoints=tuple(sorted(_pulse_corners(80.0, *NAND_V1[2:])
                             | _pulse_corners(80.0, *NAND_V2[2:]))),
    rtol=1e-6, atol=1e-6, h0=lambda rtol: 1e-2 * rtol, output=(4,))


# ------------------------------------------------------------------ chemical Akzo Nobel
# Index-1 semi-explicit DAE, n = 6, t ∈ [0, 180] (minutes): y' = f(y) for y1..y5 and
# 0 = Ks y1 y4 − y6 (y6 algebraic).

AKZO_P = dict(k1=18.7, k2=0.58, k3=0.09, k4=0.42, K=34.4, klA=3.3, Ks=115.83, pCO2=0.9,
              H=737.0)

# The Test Set's reference y(180) (computed with PSIDE at tolerance 1e-19).
AKZO_YREF = np.array([
    0.1150794920661702e+0, 0.1203831471567715e-2, 0.1611562887407974e+0,
    0.3656156421249283e-3, 0.1708010885264404e-1, 0.4873531310307455e-2])


def _akzo_rates(y, p):
    ok = y[1] >= 0.0
    sq = jnp.sqrt(jnp.maximum(y[1], 0.0))
    r1 = p["k1"] * y[0] ** 4 * sq
    r2 = p["k2"] * y[2] * y[3]
    r3 = p["k2"] / p["K"] * y[0] * y[4]
    r4 = p["k3"] * y[0] * y[3] ** 2
    r5 = p["k4"] * y[5] ** 2 * sq
    fin = p["klA"] * (p["pCO2"] / p["H"] - y[1])
    f = jnp.stack([-2.0 * r1 + r2 - r3 - r4, -0.5 * r1 - r4 - 0.5 * r5 + fin,
                   r1 - r2 + r3, -r2 + r3 - 2.0 * r4, r2 - r3 + r5,
                   p["Ks"] * y[0] * y[3] - y[5]])
    return jnp.where(ok, f, jnp.nan)


def akzo_residual(t, y, yp, p):
    """Chemical Akzo Nobel problem: (y'_1..5 − f_1..5, Ks y1 y4 − y6). NaN for y2 < 0
    (√y2; the Test Set's evaluation error)."""
    f = _akzo_rates(y, p)
    return jnp.concatenate([yp[:5] - f[:5], f[5:]])


def akzo_initial(p):
    """(y0, y'0): y0 = (0.444, 0.00123, 0, 0.007, 0, Ks·0.444·0.007), y'0 = f(y0) for
    y1..y5 and y6' = Ks (y1' y4 + y1 y4') (the derivative of the constraint)."""
    p = {k: jnp.asarray(v, jnp.float64) for k, v in p.items()}
    z = 0.0 * p["Ks"]
    y0 = jnp.stack([0.444 + z, 0.00123 + z, z, 0.007 + z, z, p["Ks"] * 0.444 * 0.007])
    f = _akzo_rates(y0, p)
    yp6 = p["Ks"] * (f[0] * y0[3] + y0[0] * f[3])
    return y0, jnp.concatenate([f[:5], yp6[None]])


akzo = Problem(
    name="akzo", residual=akzo_residual, p=AKZO_P, initial=akzo_initial, t0=0.0,
    t1=180.0, yref=AKZO_YREF, index=1, algebraic=np.array([False] * 5 + [True]),
    rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ two-bit adding unit
# Index-1 DAE in charge-oriented form, n = 350, t ∈ [0, 320]: y = (q, U) with the 175
# node charges q and voltages U, q' = f(t, U) (the static currents), 0 = g(U) − q (the
# charges). Ten logic gates (NOR, ANDOI, NAND, ORANI) of Shichman–Hodges MOSFETs add two
# two-bit numbers and a carry; the outputs are the nodes 49 (S0), 130 (S1) and 148 (the
# inverted carry), i.e. y[223], y[304], y[322].
#
# The parameters are those of the Test Set after its scaling of time by 10^4 and of the
# conductances by a stiffness factor 5 (R/(10^4·5), C·10^4, I_s·10^4·5, β·10^4·5).

_CTIME, _STIFF = 1e4, 5.0
TWOBIT_P = dict(
    RGS=0.4e2 / (_CTIME * _STIFF), RGD=0.4e2 / (_CTIME * _STIFF),
    RBS=0.1e3 / (_CTIME * _STIFF), RBD=0.1e3 / (_CTIME * _STIFF),
    CGS=0.6e-4 * _CTIME, CGD=0.6e-4 * _CTIME, CBD=2.4e-5 * _CTIME,
    DELTA=0.2e-1, CURIS=1e-15 * _CTIME * _STIFF, VTH=25.85, VDD=5.0, VBB=-2.5,
    CLOAD=0.0, COUT=2e-4 * _CTIME, PHIB=0.87,
    # depletion-type MOSFET (the loads)
    VT0_dep=-2.43, GAMMA_dep=0.2, PHI_dep=1.28, BETA_dep=53.5e-6 * _CTIME * _STIFF,
    # enhancement-type MOSFET: gain of one unit; the circuit's transistors have 4, 8
    # (two in series) and 12 (three in series) units
    VT0_enh=0.2, GAMMA_enh=0.035, PHI_enh=1.01, BETA_enh=43.7e-6 * _CTIME * _STIFF,
)

# The Test Set's voltages U(0) (a DC operating point); y0 = (g(U0), U0), y'0 = 0.
TWOBIT_U0 = np.array("""
    4.999999999996544 4.999999999999970 -2.499999999999975 -2.499999999999975 4.999999999996514
    0.000000000000000 4.999999999996514 -2.499999999999991 -2.499999999999975 0.000000000000000
    4.999999999996514 -2.499999999999991 -2.499999999999975 0.215858486765796 4.988182208251953
    -2.499999999999990 -2.499999999999975 0.204040695017748 0.011817791748026 0.192222903269723
    -2.499999999999991 -2.499999999999990 -0.228160951881239 0.204040695017748 -2.499999999999992
    -2.499999999999990 -0.228160951881241 0.000000000000000 -0.228160951881239 -2.499999999999991
    -2.499999999999992 4.999999999996547 4.999999999999970 -2.499999999999975 -2.499999999999975
    4.999999999996517 0.000000000000000 4.999999999996517 -2.499999999999991 -2.499999999999975
    0.000000000000000 4.999999999996517 -2.499999999999991 -2.499999999999975 0.215858484247529
    4.988182208251953 -2.499999999999990 -2.499999999999975 0.204040692499482 0.011817791748035
    0.192222900751447 -2.499999999999991 -2.499999999999990 -0.026041071738432 0.204040692499482
    -2.499999999999992 -2.499999999999990 -0.026041071738434 0.000000000000000 -0.026041071738432
    -2.499999999999991 -2.499999999999992 0.215858484880918 4.988182208251953 -2.499999999999990
    -2.499999999999975 0.204040693132870 0.011817791748026 0.192222901384845 -2.499999999999991
    -2.499999999999990 -0.026041071737961 0.204040693132870 -2.499999999999992 -2.499999999999990
    -0.026041071737963 0.000000000000000 -0.026041071737961 -2.499999999999991 -2.499999999999992
    4.999999999996546 4.999999999999970 -2.499999999999975 -2.499999999999975 4.999999999996516
    0.000000000000000 4.999999999996516 -2.499999999999991 -2.499999999999975 0.000000000000000
    4.999999999996516 -2.499999999999991 -2.499999999999975 0.215858481060569 4.988182208251953
    -2.499999999999990 -2.499999999999975 0.204040689312522 0.011817791748023 0.192222897564498
    -2.499999999999991 -2.499999999999990 4.734672533390068 0.204040689312522 -2.499999999999977
    -2.499999999999990 4.734672533390062 0.000000000000000 4.734672533390068 -2.499999999999991
    -2.499999999999977 4.999999999996870 4.999999999999972 -2.499999999999975 -2.499999999999975
    4.999999999996843 -0.025968303070038 4.999999999996843 -2.499999999999992 -2.499999999999975
    -0.025968303070040 0.000000000000000 -0.025968303070038 -2.499999999999991 -2.499999999999992
    4.999999999997699 4.999999999999980 -2.499999999999975 -2.499999999999975 4.999999999997678
    4.744923533081106 4.999999999997678 -2.499999999999977 -2.499999999999975 4.744923533081098
    0.000000000000000 4.744923533081106 -2.499999999999991 -2.499999999999977 0.000000000000000
    4.744923533081106 -2.499999999999991 -2.499999999999977 0.215858484844162 4.988182208251953
    -2.499999999999990 -2.499999999999975 0.204040693096114 0.011817791748023 0.192222901348091
    -2.499999999999991 -2.499999999999990 0.204040693096045 0.204040693096107 -2.499999999999990
    -2.499999999999990 0.204040693096037 0.000000000000000 0.204040693096037 -2.499999999999991
    -2.499999999999990 -0.026017361873565 0.204040693096114 -2.499999999999992 -2.499999999999990
    -0.026017361873568 -0.026017590106916 -0.026017361873565 -2.499999999999992 -2.499999999999992
    -0.026017590106918 0.000000000000000 -0.026017590106916 -2.499999999999991 -2.499999999999992
""".split(), float)

# The Test Set's reference y(320) (computed with RADAU5 at atol = rtol = 1e-5,
# h0 = 4e-5: only the three output nodes are scored).
TWOBIT_YREF = np.array("""
    0.5329676348348893e-05 0.6083199215822746e-03 -0.5802788414936773e+00 -0.1934408303298687e+00
    0.1924683208304517e+02 -0.5143798198402260e-61 0.2999386350402069e+01 -0.3048568278060051e+00
    -0.5802788414936773e+00 -0.5143798198402260e-61 0.2999386350402069e+01 -0.3048568278060051e+00
    -0.5794434527225972e+00 0.7090602915275927e-02 0.2870386839346849e+01 -0.3201995162025645e+00
    -0.1934408303298687e+00 -0.3831797456449475e+01 -0.2992291455828521e+01 -0.2883958687237743e+01
    -0.3048568278060051e+00 -0.3201995162025645e+00 -0.1408045046739925e+00 0.1225221993879181e+00
    -0.2863915327854759e+00 -0.3201995162025645e+00 0.5727830655709517e+00 -0.3568994249538271e-06
    -0.1408045061245250e+00 -0.3048568278060051e+00 -0.2863915327854759e+00 0.1046493633015554e-06
    0.1194233059399546e-04 -0.5803216340894781e+00 -0.1934408303298687e+00 0.7618503612049611e+01
    -0.1225225577378757e+00 0.2877465395282166e+01 -0.3048568278060051e+00 -0.5803216340894781e+00
    -0.5144043562440774e-61 0.2999987953020043e+01 -0.3048568278060051e+00 -0.5794087680278276e+00
    0.7090674536833933e-02 0.2870484175935613e+01 -0.3201875688249403e+00 -0.1934408303298687e+00
    -0.1508928314544720e+01 -0.2992897263001197e+01 -0.2884653493511335e+01 -0.3048568278060051e+00
    -0.3201875688249403e+00 -0.2207815941707912e-01 0.1224251495275525e+00 -0.3020231631441768e+00
    -0.3201875688249403e+00 0.6040463262883536e+00 -0.1225235639587947e+00 -0.1445997109340358e+00
    -0.3048568278060051e+00 -0.3020231631441768e+00 0.7090617704627438e-02 0.2870406940405611e+01
    -0.3201970487035549e+00 -0.1934408303298687e+00 -0.7839517558869167e+01 -0.2992292602180288e+01
    -0.2883977656734086e+01 -0.3048568278060051e+00 -0.3201970487035549e+00 -0.2207815941706669e-01
    0.1225024418897568e+00 -0.3020231631441784e+00 -0.3201970487035548e+00 0.6040463262883567e+00
    -0.1225235639587947e+00 -0.1445997109340232e+00 -0.3048568278060051e+00 -0.3020231631441784e+00
    0.2827557455215537e-06 0.3226083665770413e-04 -0.5803201765692529e+00 -0.1934408303298687e+00
    0.1349596894124011e+02 -0.5144029989944615e-61 0.2999967456407596e+01 -0.3048568278060051e+00
    -0.5803201765692529e+00 -0.5144029989944615e-61 0.2999967456407596e+01 -0.3048568278060051e+00
    -0.5794099530682210e+00 0.7090627069218701e-02 0.2870419659132725e+01 -0.3201954889813194e+00
    -0.1934408303298687e+00 -0.4564991969572258e+01 -0.2992873132356891e+01 -0.2884572066660236e+01
    -0.3048568278060051e+00 -0.3201954889813193e+00 -0.1408098389641259e+00 0.1224893544588554e+00
    -0.2863908148025885e+00 -0.3201954889813194e+00 0.5727816296051769e+00 -0.3578850567906977e-06
    -0.1408098404182732e+00 -0.3048568278060051e+00 -0.2863908148025885e+00 -0.5030971301117276e-05
    -0.5741341370739308e-03 -0.5803636949068757e+00 -0.1934408303298687e+00 0.1342161027531811e+01
    0.4675775943965132e+00 0.2878076723218615e+01 -0.3737359865057522e+00 -0.5803636949068773e+00
    0.7474719730115046e+00 -0.1224897137980597e+00 0.4675903224882113e+00 -0.3048568278060051e+00
    -0.3737359865057511e+00 0.1438859667693932e-04 0.1643466830238340e-02 -0.5802045234551009e+00
    -0.1934408303298687e+00 0.1115322810290722e+02 -0.1786085072486350e+00 -0.2245965361045817e-02
    -0.5675131482652329e+00 -0.5802045234550925e+00 0.1702539444795697e+01 -0.1225024418897565e+00
    0.2699459271144151e+01 -0.3048568278060051e+00 -0.5675131482652329e+00 -0.1224897137980597e+00
    0.2699471999235856e+01 -0.3048568278060051e+00 -0.5675131482652517e+00 0.7090737749608171e-02
    0.2870570104712901e+01 -0.3201770176390597e+00 -0.1934408303298687e+00 -0.1189155590887148e+01
    -0.2992881712346612e+01 -0.2884714042931089e+01 -0.3048568278060051e+00 -0.3201770176390597e+00
    -0.2877042169326476e+01 -0.2877046623845863e+01 -0.3201777033645129e+00 -0.3201770176390597e+00
    0.6403554067290257e+00 -0.1224897137980597e+00 -0.1449637037525297e-03 -0.3048568278060051e+00
    -0.3201777033645128e+00 -0.1512233366530073e+00 -0.1567296590745326e-03 -0.3011638803836413e+00
    -0.3201770176390597e+00 0.6023277607672893e+00 -0.1545119766856435e+00 -0.1512657482779617e+00
    -0.3007435275083740e+00 -0.3011638803836447e+00 0.6014870550167479e+00 -0.5144056888603891e-61
    -0.3199281323439955e-01 -0.3048568278060051e+00 -0.3007435275083740e+00 0.4998987079433206e+01
    0.4999992063175263e+01 -0.2499999831773528e+01 -0.2499999999999975e+01 0.4998978196639293e+01
    -0.8572996997335921e-61 0.4998977250670116e+01 -0.2499999999999991e+01 -0.2499999831773528e+01
    -0.8572996997335921e-61 0.4998977250670116e+01 -0.2499999999999991e+01 -0.2500000136347459e+01
    0.2160218554281297e+00 0.4988182249480750e+01 -0.2500000024216612e+01 -0.2499999999999975e+01
    0.2042041839026698e+00 0.1182577025842485e-01 0.1923803845763885e+00 -0.2499999999999991e+01
    -0.2500000024216612e+01 -0.2346741744566541e+00 0.2042036656465303e+00 -0.2499999823257662e+01
    -0.2500000024216613e+01 -0.2346742463623664e+00 -0.5948323749230453e-06 -0.2346741768742084e+00
    -0.2499999999999991e+01 -0.2499999823257662e+01 0.4999980114197910e+01 0.4999999843666627e+01
    -0.2499999996784775e+01 -0.2499999999999975e+01 0.4999979939782303e+01 -0.7899378970256425e-07
    0.4999979842706281e+01 -0.2499999999999991e+01 -0.2499999996784775e+01 -0.8573405937400700e-61
    0.4999979921700072e+01 -0.2499999999999991e+01 -0.2500000002605499e+01 0.2158597056211766e+00
    0.4988182207952476e+01 -0.2500000000353345e+01 -0.2499999999999975e+01 0.2040419147264534e+00
    0.1181783478030806e-01 0.1922241172634104e+00 -0.2499999999999991e+01 -0.2500000000353345e+01
    -0.3679693236179853e-01 0.2040419158792541e+00 -0.2499999772012851e+01 -0.2500000000353345e+01
    -0.3679622453612054e-01 -0.1756028654736632e-05 -0.3679533432072315e-01 -0.2499999999999991e+01
    -0.2499999772012851e+01 0.2159883644910842e+00 0.4988182235659396e+01 -0.2500000020901020e+01
    -0.2499999999999975e+01 0.2041706683167043e+00 0.1182385967214655e-01 0.1923487687491322e+00
    -0.2499999999999991e+01 -0.2500000020901020e+01 -0.3679693236177788e-01 0.2041707364829278e+00
    -0.2499999772012851e+01 -0.2500000020901019e+01 -0.3679622453609997e-01 -0.1756028654731466e-05
    -0.3679533432070254e-01 -0.2499999999999991e+01 -0.2499999772012850e+01 0.4999946292289309e+01
    0.4999999589090829e+01 -0.2499999989270124e+01 -0.2499999999999975e+01 0.4999945821029733e+01
    -0.8573383316572590e-61 0.4999945760679328e+01 -0.2499999999999991e+01 -0.2499999989270124e+01
    -0.8573383316572590e-61 0.4999945760679329e+01 -0.2499999999999991e+01 -0.2500000008700431e+01
    0.2159672042326096e+00 0.4988182257671780e+01 -0.2500000009368004e+01 -0.2499999999999975e+01
    0.2041494924505785e+00 0.1182393376824584e-01 0.1923257099293294e+00 -0.2499999999999991e+01
    -0.2500000009368003e+01 -0.2346830649402098e+00 0.2041489240980933e+00 -0.2499999822769364e+01
    -0.2500000009368002e+01 -0.2346831370442538e+00 -0.5964750946511629e-06 -0.2346830673637887e+00
    -0.2499999999999991e+01 -0.2499999822769363e+01 0.5000956289101704e+01 0.5000007783825420e+01
    -0.2500000106879903e+01 -0.2499999999999975e+01 0.5000964674053872e+01 0.9834666589775638e+00
    0.5000965207014408e+01 -0.2500000011950726e+01 -0.2500000106879903e+01 0.9834666825678713e+00
    -0.3054618845645094e-07 0.9834666965975977e+00 -0.2499999999999991e+01 -0.2500000011950726e+01
    0.4997262436706446e+01 0.4999977567095746e+01 -0.2499999724698131e+01 -0.2499999999999975e+01
    0.4997238455712048e+01 0.4703283828639512e+01 0.4997221398452132e+01 -0.2499999197373328e+01
    -0.2499999724698136e+01 0.4703273936740555e+01 -0.6816622292221013e-07 0.4703269453557049e+01
    -0.2499999999999991e+01 -0.2499999197373328e+01 -0.3054618845625812e-07 0.4703269491177070e+01
    -0.2499999999999991e+01 -0.2499999197373338e+01 0.2157164867589083e+00 0.4988182098364394e+01
    -0.2500000001646564e+01 -0.2499999999999975e+01 0.2038985905095614e+00 0.1180963378537931e-01
    0.1920890828112512e+00 -0.2499999999999991e+01 -0.2500000001646564e+01 0.2039079144284985e+00
    0.2039004902295213e+00 -0.2500000004493590e+01 -0.2500000001646564e+01 0.2039079021505135e+00
    -0.3054618845623932e-07 0.2039078862776569e+00 -0.2499999999999991e+01 -0.2500000004493590e+01
    -0.4788940197110148e-01 0.2038882763521206e+00 -0.2499999353490320e+01 -0.2500000001646564e+01
    -0.4789765786972171e-01 -0.5331577724007001e-01 -0.4790539656059958e-01 -0.2499999201728321e+01
    -0.2499999353490320e+01 -0.5331888562403928e-01 -0.8573428147674035e-61 -0.5332135539066590e-01
    -0.2499999999999991e+01 -0.2499999201728321e+01
""".split(), float)

# Inputs: A0', B0', A1', B1' (inverted bits) and the carry-in, trapezoids between 0
# and 5 V with rise and fall times 5: (low, high, delay, rise, high time, fall, period).
TWOBIT_INPUTS = ((0.0, 5.0, 0.0, 5.0, 5.0, 5.0, 20.0),
                 (0.0, 5.0, 10.0, 5.0, 15.0, 5.0, 40.0),
                 (0.0, 5.0, 30.0, 5.0, 35.0, 5.0, 80.0),
                 (0.0, 5.0, 70.0, 5.0, 75.0, 5.0, 160.0),
                 (0.0, 5.0, 150.0, 5.0, 155.0, 5.0, 320.0))


# The circuit as index arrays, built once here from its gates (1-based node numbers, as
# the Test Set's): f and g are then a few gathers, elementwise device models on whole
# arrays and one scatter-add each, so the traced program is small however many devices
# there are (written node by node, the residual was 10 488 primitive operations and its
# programs' derivatives many copies of that). The node voltages are extended by the
# fixed potentials VDD, VBB, ground and the five inputs, so that every device reads
# differences X[a] − X[b] of one vector.
_VDD, _VBB, _GND = 176, 177, 178
_INPUT = (179, 180, 181, 182, 183)             # V1, V2, V3, V4, the carry-in


class _Netlist:
    """The terms of f (currents) and g (charges), recorded device by device.

    - `res`: (row, a, b, R) — f_row −= (X_a − X_b)/R, R ∈ (RGS, RGD, RBS, RBD);
    - `diode`: (row, a, b, sign) — f_row += sign · i_bs(X_a − X_b);
    - `mos`: (source, drain, units, (a, b) × 5) — the drain current c of a MOSFET of
      `units` enhancement gains (0: the depletion load) at the five voltage differences
      (vds, vgs, vbs, vgd, vbd): f_source −= c, f_drain += c;
    - `cin`: (row, input, C) — f_row += C · dV_input/dt, C ∈ (CGS, CGD);
    - `lin`: (row, C, a, b, sign) — g_row += sign · C (X_a − X_b), C ∈ (CGS, CGD,
      CLOAD, COUT);
    - `cap`: (row, a, b, c, d) — g_row += C_bd(X_a − X_b) · (X_c − X_d).
    """

    def __init__(self):
        self.res, self.diode, self.mos, self.cin, self.lin, self.cap = ([] for _ in range(6))

    def arrays(self, terms, *dtypes):
        cols = list(zip(*terms))
        return tuple(np.asarray(c, d) for c, d in zip(cols, dtypes))


def _twobit_netlist() -> _Netlist:
    net = _Netlist()
    RGS, RGD, RBS, RBD = range(4)
    CGS, CGD, CLOAD, COUT = range(4)
    V1, V2, V3, V4, CIN = _INPUT

    # ---- currents f
    def load(i):
        """The depletion load of a gate: nodes i .. i+3, result node i+4."""
        net.mos.append((i, i + 1, 0, (i + 1, i), (i + 4, i), (i + 2, i + 4), (i + 4, i + 1),
                        (i + 3, _VDD)))
        net.res += [(i, i, i + 4, RGS), (i + 1, i + 1, _VDD, RGD),
                    (i + 2, i + 2, _VBB, RBS), (i + 3, i + 3, _VBB, RBD)]
        net.diode += [(i + 2, i + 2, i + 4, 1.0), (i + 3, i + 3, _VDD, 1.0)]

    def enh_pair(i, units, u, res, src):
        """The enhancement transistor of nodes i .. i+3 with gate voltage X_u: node i its
        source side (tied to node `src` through RGS, or ground for src None), node i+1
        its drain side (tied to node `res` through RGD), i+2 and i+3 its bulk nodes. A
        gate driven by an input also carries the input's displacement currents."""
        src = _GND if src is None else src
        net.mos.append((i, i + 1, units, (i + 1, i), (u, i), (i + 2, src), (u, i + 1),
                        (i + 3, res)))
        net.res += [(i, i, src, RGS), (i + 1, i + 1, res, RGD),
                    (i + 2, i + 2, _VBB, RBS), (i + 3, i + 3, _VBB, RBD)]
        net.diode += [(i + 2, i + 2, src, 1.0), (i + 3, i + 3, res, 1.0)]
        if u in _INPUT:
            net.cin += [(i, _INPUT.index(u), CGS), (i + 1, _INPUT.index(u), CGD)]

    def result(i, pairs):
        """The current balance of a result or coupling node i: its source resistor to
        node `a` and bulk diode from node `ab` (the first pair), and for each further
        transistor pair (d, bd) a drain resistor to d and a bulk diode from bd."""
        for j, (a, ab) in enumerate(pairs):
            net.res.append((i, i, a, RGS if j == 0 else RGD))
            net.diode.append((i, ab, i, -1.0))

    def nor(i, u1, u2):
        load(i)
        result(i + 4, [(i, i + 2), (i + 6, i + 8), (i + 10, i + 12)])
        enh_pair(i + 5, 1, u1, i + 4, None)
        enh_pair(i + 9, 1, u2, i + 4, None)

    def andoi(i, u1, u2, u3, extra=()):
        load(i)
        result(i + 4, [(i, i + 2), (i + 6, i + 8), (i + 10, i + 12), *extra])
        enh_pair(i + 5, 1, u1, i + 4, None)
        enh_pair(i + 9, 2, u2, i + 4, i + 13)
        result(i + 13, [(i + 9, i + 11), (i + 15, i + 17)])
        enh_pair(i + 14, 2, u3, i + 13, None)

    def nand_gate(i, u1, u2):
        load(i)
        result(i + 4, [(i, i + 2), (i + 6, i + 8)])
        enh_pair(i + 5, 2, u1, i + 4, i + 9)
        result(i + 9, [(i + 5, i + 7), (i + 11, i + 13)])
        enh_pair(i + 10, 2, u2, i + 9, None)

    def orani(i, u1, u2, u3):
        load(i)
        result(i + 4, [(i, i + 2), (i + 6, i + 8)])
        enh_pair(i + 5, 2, u1, i + 4, i + 9)
        result(i + 9, [(i + 5, i + 7), (i + 11, i + 13), (i + 15, i + 17)])
        enh_pair(i + 10, 2, u2, i + 9, None)
        enh_pair(i + 14, 2, u3, i + 9, None)

    nor(1, V1, V2)
    andoi(14, 5, V2, V1)
    nor(32, 18, CIN)
    andoi(45, 36, CIN, 18)
    andoi(63, 5, CIN, 18)
    nor(81, V3, V4)
    andoi(94, 85, V4, V3)
    nand_gate(112, 67, 98)
    orani(126, 116, 67, 98)
    # the carry gate: an ANDOI whose result node also drains into the series chain below
    andoi(144, 85, 5, 98, extra=[(163, 165)])
    # three enhancement transistors in series from node 148 to ground, gates: node 98,
    # node 18, the carry-in; coupling nodes 166 and 171
    enh_pair(162, 3, 98, 148, 166)
    result(166, [(162, 164), (168, 170)])
    enh_pair(167, 3, 18, 166, 171)
    result(171, [(167, 169), (173, 175)])
    enh_pair(172, 3, CIN, 171, None)

    # ---- charges g
    def lin(row, c, a, b=_GND, sign=1.0):
        net.lin.append((row, c, a, b, sign))

    def junction(a, b):
        """The bulk charge C_bd(X_a − X_b)(X_a − X_b) on node a, from node b."""
        net.cap.append((a, a, b, a, b))

    def back(i, j):
        """The bulk charge of node i against node j: C_bd(X_j − X_i)(X_i − X_j)."""
        net.cap.append((i, j, i, i, j))

    def gload(i):
        lin(i, CGS, i, i + 4)
        lin(i + 1, CGD, i + 1, i + 4)
        junction(i + 2, i + 4)
        net.cap.append((i + 3, i + 3, _VDD, i + 3, _GND))
        lin(i + 4, CGS, i + 4, i)
        lin(i + 4, CGD, i + 4, i + 1)
        back(i + 4, i + 2)
        lin(i + 4, CLOAD, i + 4)

    def gate_to_ground(i):
        """Gate capacitances and grounded bulk of the transistor at nodes i .. i+2."""
        lin(i, CGS, i)
        lin(i + 1, CGD, i + 1)
        junction(i + 2, _GND)

    def dnor(i):
        gload(i)
        back(i + 4, i + 8)
        back(i + 4, i + 12)
        gate_to_ground(i + 5)
        junction(i + 8, i + 4)
        gate_to_ground(i + 9)
        # As in the Test Set (its reference solution includes it): the bulk node i+12
        # is charged against node i+14, a node of the next gate, not against i+4.
        net.cap.append((i + 12, i + 12, i + 4, i + 12, i + 14))

    def dandoi(i):
        gload(i)
        back(i + 4, i + 8)
        back(i + 4, i + 12)
        gate_to_ground(i + 5)
        junction(i + 8, i + 4)
        lin(i + 9, CGS, i + 9)
        lin(i + 10, CGD, i + 10)
        junction(i + 11, i + 13)
        junction(i + 12, i + 4)
        back(i + 13, i + 11)
        back(i + 13, i + 17)
        lin(i + 13, CLOAD, i + 13)
        gate_to_ground(i + 14)
        junction(i + 17, i + 13)

    def dnand(i, three=False):
        gload(i)
        back(i + 4, i + 8)
        lin(i + 5, CGS, i + 5)
        lin(i + 6, CGD, i + 6)
        junction(i + 7, i + 9)
        junction(i + 8, i + 4)
        back(i + 9, i + 7)
        back(i + 9, i + 13)
        lin(i + 9, CLOAD, i + 9)
        gate_to_ground(i + 10)
        junction(i + 13, i + 9)
        if three:
            back(i + 9, i + 17)
            gate_to_ground(i + 14)
            junction(i + 17, i + 9)

    dnor(1)
    dandoi(14)
    dnor(32)
    dandoi(45)
    dandoi(63)
    dnor(81)
    dandoi(94)
    dnand(112)
    dnand(126, three=True)          # the ORANI gate
    dandoi(144)
    # gate couplings of the result nodes to the transistors they drive
    for src, gates in ((5, (19, 68, 153)), (18, (37, 59, 77, 167)), (36, (50,)),
                       (67, (117, 136)), (85, (99, 149)), (98, (122, 140, 158, 162)),
                       (116, (131,))):
        for k in gates:
            lin(src, CGS, src, k)
            lin(src, CGD, src, k + 1)
            if (src, k) not in ((18, 167), (98, 162)):   # those two are charged below
                lin(k, CGS, src, sign=-1.0)
                lin(k + 1, CGD, src, sign=-1.0)
    lin(49, COUT, 49)                               # output S0
    lin(130, COUT, 130)                             # output S1
    back(148, 165)                                  # output: inverted carry
    lin(148, COUT, 148)
    # the three series transistors
    lin(162, CGS, 162, 98)
    lin(163, CGD, 163, 98)
    junction(164, 166)
    junction(165, 148)
    back(166, 164)
    back(166, 170)
    lin(166, CLOAD, 166)
    lin(167, CGS, 167, 18)
    lin(168, CGD, 168, 18)
    junction(169, 171)
    junction(170, 166)
    back(171, 169)
    back(171, 175)
    lin(171, CLOAD, 171)
    gate_to_ground(172)
    junction(175, 171)
    return net


def _twobit_index_arrays():
    """The netlist as 0-based NumPy index arrays (node k ↦ k − 1 of X)."""
    net = _twobit_netlist()
    i = np.int32

    def z(a):
        return np.asarray(a, i) - 1

    res_row, res_a, res_b, res_r = net.arrays(net.res, i, i, i, i)
    di_row, di_a, di_b, di_sign = net.arrays(net.diode, i, i, i, float)
    src, drn, units, *ab = zip(*net.mos)
    mos_ab = np.asarray(ab, i).transpose(1, 0, 2)          # (transistor, 5, 2)
    cin_row, cin_input, cin_c = net.arrays(net.cin, i, i, i)
    lin_row, lin_c, lin_a, lin_b, lin_sign = net.arrays(net.lin, i, i, i, i, float)
    cap_row, cap_a, cap_b, cap_c, cap_d = net.arrays(net.cap, i, i, i, i, i)
    units = np.asarray(units, float)
    return dict(
        res=(z(res_row), z(res_a), z(res_b), res_r),
        diode=(z(di_row), z(di_a), z(di_b), di_sign),
        mos=(z(src), z(drn), units == 0.0, 4.0 * units, z(mos_ab[..., 0]), z(mos_ab[..., 1])),
        cin=(z(cin_row), cin_input, cin_c),
        lin=(z(lin_row), lin_c, z(lin_a), z(lin_b), lin_sign),
        cap=(z(cap_row), z(cap_a), z(cap_b), z(cap_c), z(cap_d)))


_TWOBIT = _twobit_index_arrays()
_TWOBIT_PULSES = tuple(np.asarray(c, float) for c in zip(*TWOBIT_INPUTS))


def _twobit_x(u, p, extra=()):
    """X = (U, VDD, VBB, 0, *extra): the node voltages and the fixed potentials."""
    fixed = jnp.stack([jnp.asarray(p["VDD"], u.dtype), jnp.asarray(p["VBB"], u.dtype),
                       jnp.zeros((), u.dtype)])
    return jnp.concatenate([u, fixed, *extra])


def _twobit_f(t, u, p):
    """The static currents f(t, U) of the 175 nodes."""
    v, vd = pulse(t, *_TWOBIT_PULSES)                   # the five inputs and their rates
    x = _twobit_x(u, p, (v.astype(u.dtype),))
    res_row, res_a, res_b, res_r = _TWOBIT["res"]
    di_row, di_a, di_b, di_sign = _TWOBIT["diode"]
    src, drn, dep, gain, mos_a, mos_b = _TWOBIT["mos"]
    cin_row, cin_input, cin_c = _TWOBIT["cin"]
    r = jnp.stack([p["RGS"], p["RGD"], p["RBS"], p["RBD"]])
    c = jnp.stack([p["CGS"], p["CGD"]])
    vt0 = jnp.where(dep, p["VT0_dep"], p["VT0_enh"])
    gamma = jnp.where(dep, p["GAMMA_dep"], p["GAMMA_enh"])
    phi = jnp.where(dep, p["PHI_dep"], p["PHI_enh"])
    beta = jnp.where(dep, p["BETA_dep"], gain * p["BETA_enh"])
    dv = x[mos_a] - x[mos_b]                            # (transistor, 5)
    ids = _drain_current(*dv.T, vt0, gamma, phi, beta, beta, p["DELTA"])
    terms = jnp.concatenate([
        -(x[res_a] - x[res_b]) / r[res_r],
        di_sign * _junction_current(x[di_a] - x[di_b], p["CURIS"], p["VTH"]),
        -ids, ids,
        c[cin_c] * vd[cin_input]])
    rows = np.concatenate([res_row, di_row, src, drn, cin_row])
    return jnp.zeros(175, terms.dtype).at[rows].add(terms)


def _twobit_g(u, p):
    """The node charges g(U) (gate, junction and load capacitances)."""
    x = _twobit_x(u, p)
    lin_row, lin_c, lin_a, lin_b, lin_sign = _TWOBIT["lin"]
    cap_row, cap_a, cap_b, cap_c, cap_d = _TWOBIT["cap"]
    c = jnp.stack([p["CGS"], p["CGD"], p["CLOAD"], p["COUT"]])
    terms = jnp.concatenate([
        lin_sign * c[lin_c] * (x[lin_a] - x[lin_b]),
        _junction_capacitance(x[cap_a] - x[cap_b], p["CBD"], p["PHIB"])
        * (x[cap_c] - x[cap_d])])
    rows = np.concatenate([lin_row, cap_row])
    return jnp.zeros(175, terms.dtype).at[rows].add(terms)


def twobit_residual(t, y, yp, p):
    """Two-bit adding unit: (q' − f(t, U), g(U) − q) for y = (q, U). NaN where a
    MOSFET's bulk voltage exceeds φ (the Test Set's evaluation error)."""
    q, u = y[:175], y[175:]
    return jnp.concatenate([yp[:175] - _twobit_f(t, u, p), _twobit_g(u, p) - q])


def twobit_initial(p):
    """(y0, y'0) = ((g(U0), U0), 0), as the Test Set (U0 is a DC operating point at
    t = 0, where every input is at rest)."""
    p = {k: jnp.asarray(v, jnp.float64) for k, v in p.items()}
    u0 = jnp.asarray(TWOBIT_U0)
    return jnp.concatenate([_twobit_g(u0, p), u0]), jnp.zeros(350)


twobit = Problem(
    name="twobit", residual=twobit_residual, p=TWOBIT_P, initial=twobit_initial,
    t0=0.0, t1=320.0, yref=TWOBIT_YREF, index=1,
    algebraic=np.array([False] * 175 + [True] * 175), scored=np.array([223, 304, 322]),
    breakpoints=tuple(sorted(set().union(*(_pulse_corners(320.0, *s[2:])
                                           for s in TWOBIT_INPUTS)))),
    rtol=1e-4, atol=1e-4, h0=lambda rtol: 4.0 * rtol, output=(223, 304, 322))

PROBLEMS = {pr.name: pr for pr in (transistor, transistor_semi_explicit, nand, akzo, twobit)}


# ------------------------------------------------------------------ gradient references
# Not from the Test Set: p·∂y_k(t1)/∂p (derivatives with respect to log p) of one output
# component for 2–3 physical parameters, by fourth-order central differences
# (8 (y(+h) − y(−h)) − (y(+2h) − y(−2h))) / (12 h) in the relative step h = 1e-2 of
# forward solves at `fd_rtol` (= atol), each perturbed problem with its own consistent
# initial values (tests/test_testset.py, `_central_differences`). Truncation error
# h⁴/30 · |p⁵ ∂⁵y/∂p⁵| ≈ 3e-10 for these O(1) log-derivatives, below the noise of the
# solves: the forward error does not vary smoothly with p (the step sequence changes),
# so it enters as ≈ 1.5 ε/h. `unc` is that noise as measured: |differences at h = 1e-2 −
# differences at h = 3e-3|. `y` is y_k(t1) of the unperturbed solve.


@dataclasses.dataclass(frozen=True, eq=False)
class GradientCase:
    problem: Problem
    t1: float
    comp: int                   # 0-based output component
    keys: tuple                 # the parameters
    fd_rtol: float
    fd_form: Problem            # the problem the differences were computed on
    fd: np.ndarray
    unc: np.ndarray
    y: float


GRADIENT_CASES = {
    # U8(0.2), the amplifier's output. The differences are on the semi-explicit form
    # (the same solution) at rtol 1e-9: 189 016 to 585 791 steps per solve depending on
    # the compilation's rounding; rtol 1e-10 does not reach t1 in 10⁶ steps.
    "transistor": GradientCase(
        transistor, 0.2, 7, ("beta", "r0", "c5"), 1e-9, transistor_semi_explicit,
        fd=np.array([0.0149342517, -0.0143730475, -0.3444509362]),
        unc=np.array([2.0e-6, 9.3e-7, 1.2e-6]), y=1.2369958458),
    # y1(180); 530 steps per solve.
    "akzo": GradientCase(
        akzo, 180.0, 0, ("k1", "k2", "klA"), 1e-10, akzo,
        fd=np.array([-0.0374069181, -0.0004543431, -0.003223354]),
        unc=np.array([7.5e-8, 2.6e-8, 4.0e-8]), y=0.1150794925),
    # y5(80), the gate's output; 10 385 steps per solve.
    "nand": GradientCase(
        nand, 80.0, 4, ("BETA_dep", "BETA_enh", "VT0_enh"), 1e-10, nand,
        fd=np.array([0.0329007684, -0.0002294994, 0.0031410884]),
        unc=np.array([5.9e-8, 2.8e-7, 3.3e-7]), y=4.9708370230),
    # y10(10): t1 on a kink of the input V1 (the end of its rise); y10 is the node between
    # the two enhancement transistors, which V1 drives through the capacitances (the
    # transistors carry no current before V2 rises at t = 15). 284 steps per solve.
    "nand_kink": GradientCase(
        nand, 10.0, 9, ("CGS", "CBD", "C9"), 1e-10, nand,
        fd=np.array([1.097053121, -0.1397107173, -0.4351899985]),
        unc=np.array([3.3e-7, 2.5e-8, 5.8e-8]), y=5.2362756059),
    # U5(4) of the two-bit adder, the first NOR gate's output while V1 rises; 715 steps per
    # solve. The differences are at rtol 1e-8, not 1e-10: tighter solves of this problem
    # fail (at 1e-10 the error test fails 10 times in one step, at 1e-9 so do some of the
    # perturbed solves; to t1 = 18 even 1e-7 does not finish in 10⁶ steps).
    "twobit": GradientCase(
        twobit, 4.0, 179, ("BETA_dep", "BETA_enh", "VT0_enh"), 1e-8, twobit,
        fd=np.array([0.2700497, -0.32238847, 0.02100307]),
        unc=np.array([9.2e-6, 1.1e-5, 6.3e-6]), y=0.3173999176),
}


# ------------------------------------------------------------ index 2
# Hessenberg index 2: solved with `index2=` (tests/test_index2.py).

# Water tube system: index-2 DAE, n = 49, t ∈ [0, 17·3600] s: the flows φ (18 tubes),
# friction factors λ (18) and pressures p (13 nodes) of a water network with two
# buffers (nodes 5 and 8), turbulent or laminar flow in each tube. The 11 pressures of
# the nodes without a buffer are index 2: the flow balances at those nodes (equations
# 38–48) depend on the flows only, and fix the pressures through their time derivative.
TUBE_P = dict(nu=1.31e-6, g=9.8, rho=1.0e3, rcrit=2.3e3, length=1.0e3, k=2.0e-4, d=1.0,
              b=2.0e2)
# (from, to) nodes of the 18 tubes, in the order of y1..y18 (flows) and y19..y36 (λ)
TUBE_EDGES = ((1, 2), (2, 3), (2, 6), (3, 4), (3, 5), (4, 5), (5, 10), (6, 5), (7, 4),
              (7, 8), (8, 5), (8, 10), (9, 8), (11, 9), (11, 12), (12, 7), (12, 8),
              (13, 11))
# the nodes of the pressures y37..y49: the buffers 5 and 8 first
TUBE_NODES = (5, 8, 1, 2, 3, 4, 6, 7, 9, 10, 11, 12, 13)

# The Test Set's reference y(61200).
TUBE_YREF = np.array("""
    0.2298488296477430e-002 0.1188984650746585e-002 0.1109503645730845e-002 0.1589620100314825e-003
    0.1030022640715102e-002 0.8710606306836165e-003 0.3243571480903489e-002 0.1109503645730845e-002
    0.7120986206521341e-003 0.6414613963833099e-003 0.9416978549524347e-003 0.3403428519096511e-002
    0.2397639310739395e-002 0.2397639310739395e-002 0.3348581430454180e-002 0.1353560017035444e-002
    0.1995021413418736e-002 0.5746220741193575e-002 0.4751940452918529e-001 0.4751940452918529e-001
    0.4751940452918529e-001 0.4751940452918529e-001 0.4751940452918529e-001 0.4751940452918529e-001
    0.4311196778792902e-001 0.4751940452918529e-001 0.4751940452918529e-001 0.4751940452918529e-001
    0.4751940452918529e-001 0.4249217433601160e-001 0.4732336439609648e-001 0.4732336439609648e-001
    0.4270002118868241e-001 0.4751940452918529e-001 0.4751940452918529e-001 0.3651427026675656e-001
    0.1111268591478108e+006 0.1111270045592387e+006 0.1111271078730254e+006 0.1111269851929858e+006
    0.1111269255355337e+006 0.1111269322658045e+006 0.1111269221703983e+006 0.1111270121140691e+006
    0.1111274419515807e+006 0.1111255158881087e+006 0.1111278793439227e+006 0.1111270995171642e+006
    0.1111298338971779e+006
""".split(), float)


def _tube_f(t, y, p):
    a = math.pi * p["d"] ** 2 / 4.0
    mu = p["nu"] * p["rho"]
    th = t / 3600.0
    phi, lam = y[:18], y[18:36]
    pres = jnp.zeros(14, y.dtype).at[np.array(TUBE_NODES)].set(y[36:])   # 1-based nodes
    src, dst = np.array([e[0] for e in TUBE_EDGES]), np.array([e[1] for e in TUBE_EDGES])
    ok = jnp.all(lam >= 0.0)
    rtla = jnp.sqrt(jnp.maximum(lam, 0.0))
    r = jnp.abs(phi * p["d"] / (p["nu"] * a))
    turbulent = r > p["rcrit"]
    r_eff = jnp.where(turbulent, r, p["rcrit"])
    rough = 1.0 / rtla - 1.74 + 2.0 * jnp.log10(2.0 * p["k"] / p["d"] + 18.7 / (r_eff * rtla))
    drop = pres[src] - pres[dst]
    mom = jnp.where(turbulent,
                    drop - lam * p["rho"] * p["length"] * phi ** 2 / (a ** 2 * p["d"]),
                    drop - 32.0 * mu * p["length"] * phi / (a * p["d"] ** 2))
    inflow = (1.0 - jnp.cos(jnp.exp(-th) - 1.0))
    ext = (jnp.zeros(14, y.dtype).at[1].set(inflow / 200.0).at[13].set(inflow / 80.0)
           .at[10].add(-th ** 2 * (3.0 * th ** 2 - 92.0 * th + 720.0) / 1e6))
    net = ext.at[dst].add(phi).at[src].add(-phi)
    f = jnp.concatenate([mom, rough, net[np.array(TUBE_NODES)]])
    return jnp.where(ok, f, jnp.nan)


def tube_residual(t, y, yp, p):
    """Water tube system: (v φ' − Δp-terms, −(roughness law), c p5' − net flow 5,
    c p8' − net flow 8, −net flow at the other nodes), v = ρL/A, c = b/(ρg). NaN for a
    negative friction factor (the Test Set's evaluation error)."""
    a = math.pi * p["d"] ** 2 / 4.0
    v = p["rho"] * p["length"] / a
    c = p["b"] / (p["rho"] * p["g"])
    f = _tube_f(t, y, p)
    return jnp.concatenate([v * yp[:18] - f[:18], -f[18:36], c * yp[36:38] - f[36:38],
                            -f[38:]])


def tube_initial(p):
    """The Test Set's start: no flow, λ = 0.0475194…, all pressures 109800, y' = 0."""
    y0 = jnp.concatenate([jnp.zeros(18), jnp.full(18, 0.47519404529185289807e-1),
                          jnp.full(13, 109800.0)])
    return y0, jnp.zeros(49)


tube = Problem(
    name="tube", residual=tube_residual, p=TUBE_P, initial=tube_initial, t0=0.0,
    t1=17.0 * 3600.0, yref=TUBE_YREF, index=2,
    algebraic=np.array([False] * 18 + [True] * 18 + [False] * 2 + [True] * 11),
    index2=np.array([False] * 38 + [True] * 11))


# Fekete problem: index-2 DAE (stabilized formulation), n = 160, t ∈ [0, 1000]: 20
# points on the unit sphere moving to the positions of maximal product of mutual
# distances; y = (positions (60), velocities (60), λ (20), μ (20)). Only the positions
# are scored. λ and μ are index 2, fixed by the hidden constraints of the sphere and
# tangency constraints (equations 120–159).
FEKETE_P = dict(alpha=0.5)

# The Test Set's reference y(1000) (RADAU5 at 1e-12).
FEKETE_YREF = np.array("""
    -0.4070263380333202e+00 0.3463758772791802e+00 0.8451942450030429e+00 0.7752934752521549e-01
    -0.2628662719972299e+00 0.9617122871829146e+00 0.7100577833343567e+00 0.1212948055586120e+00
    0.6936177005172217e+00 0.2348267744557627e+00 0.7449277976923311e+00 0.6244509285956391e+00
    -0.4341114738782885e+00 0.8785430442262876e+00 0.1992720444237660e+00 -0.9515059600312596e+00
    0.2203508762787005e+00 0.2146669498274008e+00 -0.6385191643609878e+00 -0.4310833259390688e+00
    0.6375425027722121e+00 -0.1464175087914336e+00 -0.9380871635228862e+00 0.3139337298744690e+00
    0.5666974065069942e+00 -0.6739221885076542e+00 0.4740073135462156e+00 0.9843259538440293e+00
    -0.1696995357819996e+00 -0.4800504290609090e-01 0.1464175087914331e+00 0.9380871635228875e+00
    -0.3139337298744656e+00 -0.7092757549979014e+00 0.5264062637139616e+00 -0.4688542938854929e+00
    -0.8665731819284478e+00 -0.4813878059756024e+00 -0.1315929352982178e+00 -0.2347897778700538e+00
    -0.8594340408013130e+00 -0.4541441287957579e+00 0.5530976940074118e+00 -0.7674370265615124e+00
    -0.3242273140037833e+00 0.7711050969896927e+00 0.6357041816577034e+00 0.3573685519777001e-01
    0.7103951209379591e+00 0.2403570431280519e+00 -0.6614886725910596e+00 -0.3038208738735660e-01
    0.4501923293640461e+00 -0.8924145871442046e+00 -0.5772996158107093e+00 -0.1766763414971813e+00
    -0.7971892020969544e+00 0.2414481766969039e+00 -0.3416456818373135e+00 -0.9082846503446250e+00
    0.2409619682166627e-15 -0.1139818460497816e-15 0.1627536276556335e-15 0.1745651819597609e-15
    -0.1914278710633076e-15 -0.6639600671806291e-16 0.1708576733899083e-15 -0.2277602521390053e-15
    -0.1350782790950654e-15 0.2411941341109454e-15 -0.1438238671800488e-15 0.8087033550666644e-16
    0.1618239105233347e-15 0.1837556152070701e-16 0.2715177369929503e-15 0.7930078658689191e-16
    0.7482020588342764e-16 0.2746974939098084e-15 0.8849338913035911e-16 -0.5940734725324115e-16
    0.4845984056889910e-16 -0.3728835248155620e-16 -0.4600332954062859e-16 -0.1548568884846698e-15
    0.2507541692375411e-16 -0.1560155223230823e-15 -0.2517946296860555e-15 -0.3739779361502470e-16
    -0.1381663620885020e-15 -0.2784051540342329e-15 0.6624397102887671e-16 0.4226207488883120e-16
    0.1571821772296610e-15 -0.4112243677286995e-16 0.1939960344265876e-15 0.2800184977692136e-15
    -0.9189023375328813e-16 0.1392943179389155e-15 0.9556003995587458e-16 -0.2234188557495892e-15
    0.1276804778190781e-15 -0.1261196211463950e-15 -0.1887754149742397e-15 -0.2140788698695373e-16
    -0.2713591291421657e-15 0.1107887633060814e-15 -0.1318443715631340e-15 -0.4521275683078691e-16
    -0.1277688851278605e-15 0.4850914012115388e-16 -0.1195891666741192e-15 -0.1569641653843750e-15
    0.1856239009452638e-15 0.9898466095646496e-16 -0.2068030800303723e-15 0.2451470336752085e-15
    0.9542986459336358e-16 -0.2456074075580993e-15 0.1532475480661800e-15 -0.1229326332276474e-15
    -0.4750000000000000e+01 -0.4750000000000001e+01 -0.4750000000000000e+01 -0.4750000000000000e+01
    -0.4750000000000000e+01 -0.4750000000000000e+01 -0.4750000000000000e+01 -0.4750000000000000e+01
    -0.4750000000000000e+01 -0.4750000000000000e+01 -0.4750000000000001e+01 -0.4750000000000001e+01
    -0.4750000000000000e+01 -0.4750000000000000e+01 -0.4750000000000000e+01 -0.4750000000000000e+01
    -0.4749999999999999e+01 -0.4750000000000000e+01 -0.4750000000000000e+01 -0.4750000000000000e+01
    -0.3537526598492654e-19 0.2338193888161182e-18 -0.3267771993164953e-18 0.2915679914072042e-18
    0.1965183195887647e-18 -0.6224992924096233e-19 -0.1715878416756298e-18 -0.2704741705248803e-18
    0.3008700893194513e-18 -0.2703121624910402e-18 0.4243755291982164e-18 0.2862063003949612e-18
    0.1222125408406218e-19 -0.4958862706817728e-18 -0.7070673036251212e-18 -0.4454983024194383e-18
    -0.1125384872521777e-18 0.1512898724592511e-18 -0.6163704221424137e-19 0.6255426995473074e-19
""".split(), float)


def _fekete_f(y, p):
    n = 20
    pos, vel = y[:3 * n].reshape(n, 3), y[3 * n:6 * n].reshape(n, 3)
    lam, mu = y[6 * n:7 * n], y[7 * n:]
    diff = pos[:, None, :] - pos[None, :, :]
    rn = jnp.sum(diff ** 2, axis=-1) + jnp.eye(n)          # the diagonal is not used
    force = jnp.sum(jnp.where(jnp.eye(n, dtype=bool)[..., None], 0.0, diff / rn[..., None]),
                    axis=1)
    dpos = vel + 2.0 * mu[:, None] * pos
    dvel = -p["alpha"] * vel + 2.0 * lam[:, None] * pos + force
    phi = jnp.sum(pos ** 2, axis=1) - 1.0
    gpq = 2.0 * jnp.sum(pos * vel, axis=1)
    return jnp.concatenate([dpos.ravel(), dvel.ravel(), phi, gpq])


def fekete_residual(t, y, yp, p):
    """Fekete problem: (y'_1..120 − f, |p_i|² − 1, 2 p_i·q_i)."""
    f = _fekete_f(y, p)
    return jnp.concatenate([yp[:120] - f[:120], f[120:]])


# The parameters of the start (Li & Petzold, DASPKADJOINT §7.3): the latitudes β = α_odd π
# and phase offsets α_even π of the four circles.
FEKETE_ALPHA = (3 / 8, 1 / 13, 1 / 8, 1 / 29, -2 / 15, 1 / 7, -3 / 10, 1 / 17)


def fekete_initial(p, alpha=FEKETE_ALPHA):
    """The Test Set's start: the 20 points on four circles of latitude, zero
    velocities, μ = 0, λ_i = −p_i·(force on i)/2 (so that the velocities' constraint holds
    to first order), y' = f(y). Differentiable in `alpha` (DASPKADJOINT's sensitivity
    parameters α1…α8; the defaults are the Test Set's)."""
    pi = math.pi
    a = alpha
    rings = [(3, lambda i: 2 * pi * i / 3 + a[1] * pi, a[0] * pi),
             (7, lambda i: 2 * pi * i / 7 + a[3] * pi, a[2] * pi),
             (6, lambda i: 2 * pi * i / 6 + a[5] * pi, a[4] * pi),
             (4, lambda i: 2 * pi * (i - 1) / 4 + a[7] * pi, a[6] * pi)]
    pts = []
    for count, omega, beta in rings:
        for i in range(1, count + 1):
            w = omega(i)
            pts.append(jnp.stack([jnp.cos(w) * jnp.cos(beta), jnp.sin(w) * jnp.cos(beta),
                                  jnp.sin(beta)]))
    y = jnp.concatenate([jnp.stack(pts).ravel(), jnp.zeros(100)])
    f = _fekete_f(y, p)
    lam = -jnp.sum(y[:60].reshape(20, 3) * f[60:120].reshape(20, 3), axis=1) / 2.0
    y = y.at[120:140].set(lam)
    return y, _fekete_f(y, p)


fekete = Problem(
    name="fekete", residual=fekete_residual, p=FEKETE_P, initial=fekete_initial, t0=0.0,
    t1=1000.0, yref=FEKETE_YREF, index=2, scored=np.arange(60),
    algebraic=np.array([False] * 120 + [True] * 40), index2=np.array([False] * 120 + [True] * 40))


# Slider crank (Simeon, "Modelling a flexible slider crank mechanism by a mixed system of
# DAEs and PDEs"): index-2 DAE, n = 24, t ∈ [0, 0.1] s. A rigid crank (angle φ1, driven
# at the constant speed ω by the constraint φ1 = ωt, written on the velocity level)
# turns an elastic connecting rod (angle φ2) whose end slides on a horizontal guide (the
# sliding block at x3). The rod's deformation has four coefficients q: two lateral modes
# (sine shapes) and two longitudinal nodes of a quadratic element. y = (φ1, φ2, x3, q1..q4
# (7 positions), their velocities (7), accelerations w (7), multipliers λ (3)). The
# positions and velocities are index 1, w and λ index 2 (the Test Set's nind = (14, 10,
# 0)); the Test Set scores the positions only.
CRANK_P = dict(m1=0.36, m2=0.151104, m3=0.075552, l1=0.15, l2=0.30, j1=0.002727,
               j2=0.0045339259, ee=0.20e12, nue=0.30, bb=0.0080, hh=0.0080, rho=7870.0,
               grav=0.0, omega=150.0)
# The Test Set's element matrices use π rounded to 8 digits; we keep its value so that
# our residual is the one its reference solution was computed for: with it the
# reference satisfies the equations of motion to 1e-15 of their terms, with π to only
# 4e-8 (the coefficients differ by up to 6e-8).
_CRANK_PI = 3.1415927

# The Test Set's reference y(0.1) (MEBDFI at rtol = atol = 1e-14), for the default
# model: linear stiffness, no damping.
CRANK_YREF = np.array("""
    0.1500000000000104e+002 -0.3311734988256260e+000 0.1697373328427860e+000
    0.1893192899613509e-003 0.2375751249879174e-004 -0.5323896770569702e-005
    -0.8363313279112129e-005 0.1500000000000000e+003 0.6025346755138369e+002
    -0.8753116326670527e+001 -0.3005541400289738e-001 -0.5500431812571696e-002
    0.4974111734266989e-003 0.1105560003626645e-002 0.0 0.6488737541276957e+004
    0.2167938629509884e+004 0.3391137060286523e+002 0.1715134772216488e+000
    -0.1422449408912512e+001 0.1003946428124810e+001 -0.6232935833287916e+002
    -0.1637920993367306e+003 0.2529857947066878e+002
""".split(), float)


def _crank_fe(p):
    """The rod's finite-element data: mass M_q, stiffness K_q, the antisymmetric
    Coriolis coupling B_q, and the coupling vectors c1, c2, c12, c21 (4 coefficients)."""
    pi = _CRANK_PI
    fm = p["rho"] * p["bb"] * p["hh"] * p["l2"]
    fk = p["ee"] * p["bb"] * p["hh"] / p["l2"]
    fb = p["bb"] * p["hh"] * p["l2"]
    z = 0.0 * fm
    mq = jnp.array([[fm * 0.5, z, z, z], [z, fm * 0.5, z, z], [z, z, fm * 8.0, fm],
                    [z, z, fm, fm * 2.0]])
    bend = (p["hh"] / p["l2"]) ** 2
    kq = jnp.array([[fk * pi ** 4 / 24.0 * bend, z, z, z],
                    [z, fk * pi ** 4 * 2.0 / 3.0 * bend, z, z],
                    [z, z, fk * 16.0 / 3.0, -fk * 8.0 / 3.0],
                    [z, z, -fk * 8.0 / 3.0, fk * 7.0 / 3.0]])
    b13, b14, b24 = -fb * 16.0 / pi ** 3, fb * (8.0 / pi ** 3 - 1.0 / pi), fb * 0.5 / pi
    bq = jnp.array([[z, z, b13, b14], [z, z, z, b24], [-b13, z, z, z], [-b14, -b24, z, z]])
    c1 = jnp.array([z, z, fb * 2.0 / 3.0, fb / 6.0])
    c2 = jnp.array([fb * 2.0 / pi, z, z, z])
    c12 = p["l2"] * jnp.array([z, z, fb / 3.0, fb / 6.0])
    c21 = p["l2"] * jnp.array([fb / pi, -fb * 0.5 / pi, z, z])
    return mq, kq, bq, c1, c2, c12, c21


def _crank_equations(t, y, w, lam, p):
    """(M(φ, q) w − f(φ, q, v) + Gᵀλ, G v − (0, 0, ω)) for the positions and velocities
    y[:14], accelerations w and multipliers λ: the equations of motion and the
    velocity-level constraints (the guide's two and the crank's drive), G =
    ∂(position constraints)/∂(positions)."""
    rho, l1, l2 = p["rho"], p["l1"], p["l2"]
    m2, grav = p["m2"], p["grav"]
    mq, kq, bq, c1, c2, c12, c21 = _crank_fe(p)
    phi1, phi2 = y[0], y[1]
    q, v, qd = y[3:7], y[7:14], y[10:14]
    v1, v2 = v[0], v[1]
    c_1, s_1, c_2, s_2 = jnp.cos(phi1), jnp.sin(phi1), jnp.cos(phi2), jnp.sin(phi2)
    c12_, s12_ = jnp.cos(phi1 - phi2), jnp.sin(phi1 - phi2)
    c1q, c1qd, c2q, c2qd = c1 @ q, c1 @ qd, c2 @ q, c2 @ qd
    mqq = mq @ q
    bqqd = bq @ qd
    # the mass matrix (symmetric): rigid block, rod-mode block M_q and their coupling
    a12 = 0.5 * l1 * l2 * m2 * c12_ + rho * l1 * (s12_ * c2q + c12_ * c1q)
    a22 = p["j2"] + q @ mqq + 2.0 * rho * (c12 @ q)
    row1 = rho * l1 * (-s12_ * c1 + c12_ * c2)
    row2 = rho * c21 + rho * (q @ bq)
    zero = 0.0 * a12
    top = jnp.stack([jnp.stack([p["j1"] + m2 * l1 ** 2, a12, zero]),
                     jnp.stack([a12, a22, zero]),
                     jnp.stack([zero, zero, p["m3"] + zero])])
    coupling = jnp.stack([row1, row2, jnp.zeros(4, y.dtype)])
    am = jnp.block([[top, coupling], [coupling.T, mq]])
    # the constraint Jacobian: the rod's end (length l2 + q4 along the rod) on the
    # guide y = 0 at x = x3, and the crank angle
    gp = jnp.stack([
        jnp.stack([l1 * c_1, (l2 + q[3]) * c_2, zero, zero, zero, zero, s_2]),
        jnp.stack([l1 * s_1, (l2 + q[3]) * s_2, 1.0 + zero, zero, zero, zero, -c_2]),
        jnp.stack([1.0 + zero, zero, zero, zero, zero, zero, zero])])
    # forces: centrifugal and Coriolis terms of the rigid and elastic motion, gravity
    f1 = (-0.5 * l1 * grav * (p["m1"] + 2.0 * m2) * c_1 - 0.5 * l1 * l2 * m2 * v2 ** 2 * s12_
          + rho * l1 * v2 ** 2 * (-s12_ * c1q + c12_ * c2q)
          - 2.0 * rho * l1 * v2 * (c12_ * c1qd + s12_ * c2qd))
    f2 = (-0.5 * l2 * grav * m2 * c_2 + 0.5 * l1 * l2 * m2 * v1 ** 2 * s12_
          + rho * l1 * v1 ** 2 * (s12_ * c1q - c12_ * c2q)
          - 2.0 * rho * v2 * (c12 @ qd) - 2.0 * v2 * (qd @ mqq) - rho * (qd @ bqqd)
          - rho * grav * (c_2 * c1q - s_2 * c2q))
    fq = (v2 ** 2 * mqq
          + rho * (v2 ** 2 * c12 + l1 * v1 ** 2 * (c12_ * c1 + s12_ * c2) + 2.0 * v2 * bqqd)
          - rho * grav * (s_2 * c1 + c_2 * c2) - kq @ q)
    f = jnp.concatenate([jnp.stack([f1, f2, zero]), fq])
    motion = am @ w - f + gp.T @ lam
    velocity = gp @ v - jnp.stack([zero, zero, p["omega"] + zero])
    return motion, velocity


def crank_residual(t, y, yp, p):
    """Slider crank: (φ' − v, v' − w, M w − f + Gᵀλ, G v − (0, 0, ω)) for the positions
    φ = (φ1, φ2, x3, q), velocities v, accelerations w and multipliers λ. The Test Set's
    default model (linear stiffness of the rod, no damping), the one its reference
    solution is for; its options of a nonlinear stiffness term and of damping are not
    ported (no reference to check them against)."""
    motion, velocity = _crank_equations(t, y, y[14:21], y[21:24], p)
    return jnp.concatenate([yp[:7] - y[7:14], yp[7:14] - y[14:21], motion, velocity])


def crank_initial(p):
    """The Test Set's default start (its option ini = 1: the rod already deformed as in
    the steady periodic motion), with y' = (v, w, 0). Given for the nominal parameters
    (9 digits in the positions and velocities)."""
    del p
    y0 = jnp.array([0.0, 0.0, 0.450016933, 0.0, 0.0, 0.103339863e-4, 0.169327969e-4,
                    0.150000000e3, -0.749957670e2, -0.268938672e-5, 0.444896105,
                    0.463434311e-2, -0.178591076e-5, -0.268938672e-5,
                    0.0, -1.344541576008661e-3, -5.062194923138079e3,
                    -6.833142732779555e-5, 1.449382650173157e-8, -4.268463211410861,
                    2.098334687947376e-1, -6.397251492537153e-8, 3.824589508329281e2,
                    -4.376060460948886e-9])
    return y0, jnp.concatenate([y0[7:21], jnp.zeros(10)])


# `index2` marks λ only: our mask names the index-2 variables *and* the constraints at
# their indices, and the equations at the accelerations' indices are the equations of
# motion, not constraints (they depend on w and λ). With λ declared, w is an index-1
# algebraic variable given λ, but it inherits λ's behaviour (w = M⁻¹(f − Gᵀλ)): its
# local error estimate is one order lower in h, so a solve of this form also needs
# `suppress_algebraic_error=True`, and w's column of the iteration matrix is not scaled
# by cj (tests/test_index2.py: at small steps the pivot test then reports the matrix
# singular). `crank_reduced` avoids both.
crank = Problem(
    name="crank", residual=crank_residual, p=CRANK_P, initial=crank_initial, t0=0.0,
    t1=0.1, yref=CRANK_YREF, index=2, scored=np.arange(7),
    algebraic=np.array([False] * 14 + [True] * 10),
    index2=np.array([False] * 21 + [True] * 3))


# The slider crank with the accelerations eliminated: the equations of motion written
# as M(φ, q) v' = f − Gᵀλ, y = (φ, v, λ). A Hessenberg index-2 DAE in the form `index2`
# declares (x = (φ, v), z = λ, g = G v − (0, 0, ω), g_x f_z = −G M⁻¹ Gᵀ nonsingular), with
# the same solution; `to_testset` recovers w from (φ, v, λ) (at the nominal parameters),
# so `yref`, `scd` and `mescd` are in the Test Set's 24 variables.
def crank_reduced_residual(t, y, yp, p):
    """The slider crank without the accelerations (n = 17): (φ' − v, M v' − f + Gᵀλ,
    G v − (0, 0, ω)) in y = (φ, v, λ), the same solution as `crank_residual`'s."""
    motion, velocity = _crank_equations(t, y, yp[7:14], y[14:17], p)
    return jnp.concatenate([yp[:7] - y[7:14], motion, velocity])


def crank_accelerations(y, p):
    """w = M⁻¹ (f − Gᵀλ) of a state y = (φ, v, λ) of the reduced form: the
    accelerations (the equations of motion are affine in w)."""
    y = jnp.asarray(y, jnp.float64)
    motion = lambda w: _crank_equations(0.0, y, w, y[14:17], p)[0]   # noqa: E731
    zero = jnp.zeros(7, y.dtype)
    return -jnp.linalg.solve(jax.jacfwd(motion)(zero), motion(zero))


def crank_reduced_initial(p):
    y0, yp0 = crank_initial(p)
    return jnp.concatenate([y0[:14], y0[21:]]), jnp.concatenate([yp0[:14], jnp.zeros(3)])


crank_reduced = Problem(
    name="crank_reduced", residual=crank_reduced_residual, p=CRANK_P,
    initial=crank_reduced_initial, t0=0.0, t1=0.1, yref=CRANK_YREF, index=2,
    scored=np.arange(7), algebraic=np.array([False] * 14 + [True] * 3),
    index2=np.array([False] * 14 + [True] * 3),
    to_testset=lambda y: np.concatenate([y[:14], crank_accelerations(y, CRANK_P), y[14:]]))

INDEX2_PROBLEMS = {pr.name: pr for pr in (tube, fekete, crank, crank_reduced)}
