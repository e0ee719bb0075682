"""A PuLP model solved by HiGHS, each through its public API only.

PuLP builds the model (variables, expressions, constraints); its documented export,
``LpProblem.toDataclass()`` (or ``toDict()``, the same fields as a dict, where a PuLP lacks the
first: converting the dataclasses to dicts took a tenth of a large plan's time), is handed to
``highspy.Highs`` column by column and row by row.  We own the solver object, so the warm start
(``setSolution`` with the integer variables of a known partition), the status HiGHS reached and
its MIP gap are asked of HiGHS itself.  PuLP's own HiGHS interface is not used: in PuLP 3 it takes
no warm start, and the solver model and column indices it keeps are private (PuLP 4 removed the
``index`` the first version of this code read).

A solve is bounded by *effort*, not seconds: HiGHS checks its limits at points of its own
progress (``checkLimits``: in the root's cut loop, between nodes), and the solve is interrupted
through HiGHS's MIP-interrupt callback once its checks, with every :data:`NODES_PER_CHECK` nodes
of the branch and bound counted as one more, reach ``effort``.  Where it stops is then a fact of
the model, not of the machine's load, so one command on one machine gives one plan, quiet or busy.
The wall-clock limit stays as a safety net far above that; a solve it stops says so.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

import numpy as np
import pulp  # before highspy: PuLP 4 loads highspy's C++ runtime globally first, or HiGHS's run crashes

import highspy  # noqa: E402,I001


@dataclass
class Solved:
    values: dict[str, float] | None  # by variable name; None where HiGHS found no feasible point
    status: str  # HiGHS's own words ("Optimal", "Infeasible", ...), or where its effort or time stopped it
    gap: float  # the relative MIP gap HiGHS reached
    n_variables: int
    n_constraints: int
    checks: int = 0  # HiGHS's limit checks the solve took
    nodes: int = 0  # and its branch-and-bound nodes


@contextlib.contextmanager
def _native_stdout_silenced():
    """Our stdout (``mobius.plan --json``, the run's header) must carry only what we print."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


# HiGHS prints its banner from C++ when the process's first solver is created, whatever its
# options say.  That solver is made here, at import, with stdout silenced; the solvers made after
# print nothing (``output_flag`` off), so solves need no silencing and may run on several threads
# at once, each with a solver of its own (HiGHS releases the GIL while it solves).
with _native_stdout_silenced():
    highspy.Highs()


# The root's limit checks come a few LP re-solves apart; past the root HiGHS checks only between
# batches of nodes, a hundred or more, so a count of checks alone lets the search run on for
# minutes.  Measured on Llama-3.1-8B's partition at 8 GPUs (4,506 rows, 2 cores): the root's 30
# checks took 0.1-0.4 s each, the search's nodes 15-35 ms each, about ten to a root check; its
# 28 checks after the root took 110 s (2,956 nodes) and the plan kept was the same.
NODES_PER_CHECK = 10

# Far above what a solve's effort takes on a busy machine: it stops only a solve gone wrong.
SAFETY_TIME_LIMIT_S = 600.0


def _get(record, field: str):
    """A field of PuLP's export, as a dataclass or as a dict."""
    return record[field] if isinstance(record, dict) else getattr(record, field)


def solve(problem: pulp.LpProblem, start: dict[str, float], effort: int, gap: float, time_limit_s: float) -> Solved:
    """Minimise ``problem`` from the incumbent ``start`` (values of some of its variables, by name;
    HiGHS completes the rest or drops it if it is infeasible), stopping at the relative ``gap``, at
    ``effort`` (HiGHS's limit checks, its nodes counted in), or at ``time_limit_s`` (the safety
    net), whichever first."""
    model = problem.toDataclass() if hasattr(problem, "toDataclass") else problem.toDict()
    if _get(_get(model, "parameters"), "sense") != pulp.LpMinimize:
        raise ValueError("solve minimises; the problem maximises")
    variables, constraints = _get(model, "variables"), _get(model, "constraints")
    column = {_get(v, "name"): j for j, v in enumerate(variables)}
    n = len(variables)
    cost = np.zeros(n)
    for c in _get(_get(model, "objective"), "coefficients"):
        cost[column[_get(c, "name")]] = _get(c, "value")
    inf = highspy.kHighsInf
    binary = [_get(v, "cat") == "Binary" for v in variables]
    lower = np.array([(0.0 if b else -inf) if (lo := _get(v, "lowBound")) is None else lo
                      for v, b in zip(variables, binary)], dtype=np.float64)
    upper = np.array([(1.0 if b else inf) if (up := _get(v, "upBound")) is None else up
                      for v, b in zip(variables, binary)], dtype=np.float64)
    integer = np.array([j for j, v in enumerate(variables) if _get(v, "cat") in ("Integer", "Binary")],
                       dtype=np.int32)

    # Each constraint reads sum(coefficients) + constant (sense) 0.
    starts, index, value, row_lo, row_hi = [], [], [], [], []
    for c in constraints:
        starts.append(len(index))
        for term in _get(c, "coefficients"):
            if x := _get(term, "value"):
                index.append(column[_get(term, "name")])
                value.append(x)
        rhs, sense = -_get(c, "constant"), _get(c, "sense")
        row_lo.append(rhs if sense in (pulp.LpConstraintGE, pulp.LpConstraintEQ) else -inf)
        row_hi.append(rhs if sense in (pulp.LpConstraintLE, pulp.LpConstraintEQ) else inf)

    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("mip_rel_gap", float(gap))
    checks = 0

    def at_limit_check(event):
        nonlocal checks
        checks += 1
        if checks + event.data_out.mip_node_count / NODES_PER_CHECK >= effort:
            event.interrupt()

    highs.cbMipInterrupt += at_limit_check
    highs.addCols(n, cost, lower, upper, 0, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))
    if len(integer):
        highs.changeColsIntegrality(len(integer), integer,
                                    np.full(len(integer), int(highspy.HighsVarType.kInteger), np.uint8))
    highs.addRows(len(constraints), np.array(row_lo, np.float64), np.array(row_hi, np.float64), len(index),
                  np.array(starts, np.int32), np.array(index, np.int32), np.array(value, np.float64))
    known = [(column[name], x) for name, x in start.items() if name in column]
    if known:
        highs.setSolution(len(known), np.array([j for j, _ in known], np.int32),
                          np.array([x for _, x in known], np.float64))
    highs.run()
    info = highs.getInfo()
    found = int(info.primal_solution_status) == int(highspy.SolutionStatus.kSolutionStatusFeasible)
    values = dict(zip(column, highs.getSolution().col_value)) if found else None
    status = highs.getModelStatus()
    stopped = f"Effort limit reached ({effort}: {checks} limit checks, {info.mip_node_count} nodes)"
    words = {highspy.HighsModelStatus.kInterrupt: stopped,
             highspy.HighsModelStatus.kTimeLimit: "Time limit reached (the safety net: on another load, another "
                                                  "answer)"}.get(status) or highs.modelStatusToString(status)
    return Solved(values, words, info.mip_gap, n, len(constraints), checks, info.mip_node_count)
