"""A stand-in for PuLP with only the public API the partition MIP may use: ``LpProblem(name,
sense)``, ``add_variable``, ``+=`` of constraints and of the objective, ``toDict()`` (its documented
export; no ``toDataclass()``, so the solver's dict path is the one these tests take), ``lpSum`` and the sense constants.  Anything else the MIP reached for (a solver interface,
a variable's column index, the solver model) is missing here and fails the tests that plan with it.
"""

from __future__ import annotations

LpMinimize, LpMaximize = 1, -1
LpConstraintLE, LpConstraintEQ, LpConstraintGE = -1, 0, 1


class LpAffineExpression:
    __slots__ = ("terms", "constant")

    def __init__(self, terms: dict | None = None, constant: float = 0.0):
        self.terms = dict(terms or {})  # variable name -> coefficient
        self.constant = float(constant)

    @staticmethod
    def of(x) -> LpAffineExpression:
        return x if isinstance(x, LpAffineExpression) else LpAffineExpression({}, x)

    def __add__(self, other):
        other = LpAffineExpression.of(other)
        terms = dict(self.terms)
        for name, c in other.terms.items():
            terms[name] = terms.get(name, 0.0) + c
        return LpAffineExpression(terms, self.constant + other.constant)

    __radd__ = __add__

    def __mul__(self, k):
        if isinstance(k, LpAffineExpression):
            if k.terms and self.terms:
                raise TypeError("a product of two variables is not linear")
            k, self = (k.constant, self) if not k.terms else (self.constant, k)
        return LpAffineExpression({n: c * k for n, c in self.terms.items()}, self.constant * k)

    __rmul__ = __mul__

    def __neg__(self):
        return self * -1.0

    def __sub__(self, other):
        return self + (-LpAffineExpression.of(other))

    def __rsub__(self, other):
        return LpAffineExpression.of(other) - self

    def __le__(self, other):
        return LpConstraint(self - other, LpConstraintLE)

    def __ge__(self, other):
        return LpConstraint(self - other, LpConstraintGE)

    def __eq__(self, other):
        return LpConstraint(self - other, LpConstraintEQ)

    __hash__ = None


class LpVariable(LpAffineExpression):
    __slots__ = ("name",)

    def __init__(self, name: str):
        super().__init__({name: 1.0})
        self.name = name


class LpConstraint:
    def __init__(self, expression: LpAffineExpression, sense: int):
        self.expression, self.sense = expression, sense


def lpSum(items) -> LpAffineExpression:
    total = LpAffineExpression()
    for x in items:
        total = total + x
    return total


class LpProblem:
    def __init__(self, name: str, sense: int = LpMinimize):
        self.name, self.sense = name, sense
        self.variables: list[dict] = []
        self.constraints: list[LpConstraint] = []
        self.objective = LpAffineExpression()

    def add_variable(self, name: str, lowBound=None, upBound=None, cat: str = "Continuous") -> LpVariable:
        self.variables.append({"name": name, "cat": cat, "lowBound": lowBound, "upBound": upBound,
                               "varValue": None, "dj": None})
        return LpVariable(name)

    def __iadd__(self, other):
        if isinstance(other, LpConstraint):
            self.constraints.append(other)
        else:
            self.objective = LpAffineExpression.of(other)
        return self

    def toDict(self) -> dict:
        def coefficients(e):
            return [{"name": n, "value": c} for n, c in e.terms.items()]

        return {"parameters": {"name": self.name, "sense": self.sense, "status": 0, "sol_status": 0},
                "objective": {"name": None, "coefficients": coefficients(self.objective)},
                "variables": [dict(v) for v in self.variables],
                "constraints": [{"name": None, "sense": c.sense, "coefficients": coefficients(c.expression),
                                 "pi": None, "constant": c.expression.constant} for c in self.constraints],
                "sos1": [], "sos2": []}
