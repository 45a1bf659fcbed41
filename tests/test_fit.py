"""The calibration fit keeps only plausible coefficients, whatever the measured steps say (a loaded machine's
steps can make every feature look like noise): no negative overhead, no wild compute scale."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.profile.fit import _plausible_fit, _Steps


def _steps(meas, n, p, comp, comp_d, dec_only, cold) -> _Steps:
    a = lambda v: np.asarray(v, dtype=float)  # noqa: E731
    return _Steps(comp=a(comp), comp_d=a(comp_d), base=np.full(len(meas), 100.0), n=a(n), p=a(p),
                  dec_only=a(dec_only), cold=a(cold), meas=a(meas))


def _check(s: _Steps, coef: dict) -> None:
    dec_bound = 0.5 * float(np.median(s.meas[s.dec_only > 0])) if s.dec_only.any() else 0.0
    for f, c in coef.items():
        if f.startswith("scale"):
            assert 0.8 <= c <= 1.25, (f, c)
        elif f == "decode_fixed":
            assert abs(c) <= dec_bound, (f, c)
        else:
            assert c >= 0, (f, c)


def test_steps_below_the_tables_leave_no_negative_overhead():
    """Steps measured below what the tables' overhead alone predicts (a timer's noise on a shared machine) make
    every feature implausible in turn; the fit then keeps none of them, never the last one it tried."""
    s = _steps([10.0] * 4, [1] * 4, [0, 0, 0, 1], [0.0] * 4, [0.0] * 4, [1, 1, 1, 0], [0] * 4)
    coef = _plausible_fit(s)
    _check(s, coef)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 2), st.floats(0, 5e4), st.floats(0, 5e3),
                          st.booleans(), st.floats(10, 1e5)), min_size=4, max_size=40))
def test_the_fit_is_plausible_for_any_measurements(rows):
    n = [r[0] for r in rows]
    p = [min(r[1], r[0]) for r in rows]
    dec_only = [1 if pp == 0 else 0 for pp in p]
    cold = [d * int(r[4]) for d, r in zip(dec_only, rows)]
    s = _steps([r[5] for r in rows], n, p, [r[2] * (pp > 0) for r, pp in zip(rows, p)], [r[3] for r in rows],
               dec_only, cold)
    _check(s, _plausible_fit(s))
