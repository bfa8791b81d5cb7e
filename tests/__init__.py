"""The test suite, a package so that its helpers — the problems (`problems.py`), the Test
Set for IVP Solvers (`testset.py`), the food web (`foodweb.py`) and the tables of IDAS
reference results (`ida_*_reference.py`) — are imported by name (`from .problems import
...` here, `from tests import foodweb` in the benchmarks), without `sys.path` changes."""
