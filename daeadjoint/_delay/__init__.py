"""Constant-lag delay DAEs F(t, y, y', y(t − τ₁), …, y(t − τ_m), args) = 0: the step
history the integrator keeps for the lagged values (`buffer.py`) and the solve with its
discontinuity tracking and forward-mode derivatives (`solve.py`)."""
