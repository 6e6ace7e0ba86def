"""kmock's request matching without its quadratic cost (the e2e, operator and gateway
tests' emulated API servers).

kmock keeps every request an emulator has served (tests count them: a view such as
`emulator["list v1/pods"]` iterates them), and answers a new request by asking each
reaction, in priority order, whether the new request is among the requests its view
selects: `request in view` (`View.__contains__`) walks the view over the whole history,
re-running every filter's criteria on every earlier request. A cluster that lives for a
test module serves a few thousand requests (the kubelet's 0.2 s ticks, the operator,
kubectl, the tests' polls), so by the end each new request cost tens of milliseconds
of criteria checks: in the e2e and operator test files, 60-70% of the pytest process's
CPU time went to `Criteria._check` (sampled, 2026-12-03). With `install()` (2-core machine, 2026-12-03):
e2e/test_user_path.py alone (-n 0) took 82 s of user CPU without it, 49 s with it.

`install()` answers `request in view` for the views the reactions are made of without
walking the history, where the answer is provably the same:

- `Filter` (exactly that class) whose criteria are kmock's `K8sCriteria` or
  `HTTPCriteria`: the filter yields the requests of its source that pass its criteria,
  so the request is in it iff its criteria pass for that request and it is in the
  source. Those two classes' verdicts are comparisons of the pattern with the request's
  fields (`Criteria._check`): no side effects, so not evaluating them for the earlier
  requests is invisible. (A criteria that raised for some request would, in kmock,
  raise again for every later request it is walked over; here only for that request.)
  Callables, events, futures and the other criteria classes go the kmock way.
- `Priority` (a hint on the chain): its requests are its source's.
- a `Root` (the emulator) whose class keeps kmock's `Root.__iter__`: its requests are
  its `_requests` list, searched by identity from the newest end (a new request is
  the last one), as kmock searches it from the oldest.

Any other view (slices, groups, exclusions, reactions, streams, subclasses) is walked
as kmock walks it. Views iterated by tests, counts and the history are untouched.
Checked against kmock 0.8; a kmock without these classes is left alone, and
PAGEFLEET_KMOCK_AS_IS=1 leaves it alone too.

Installed in one place: e2e/emulator.py, when it is imported (the e2e clusters and the
operator tests' harness, under pytest or not). In a run of the suite every xdist worker
imports it while collecting, so every kmock emulator of the run gets it; a run of
tests/gateway/test_kube.py alone (the one kmock user that does not import it) does
without: its emulators live for one test each and serve too few requests for it to
matter (29-30 s of CPU either way, measured). Installing twice is a no-op.
"""

from __future__ import annotations

import os


def install() -> bool:
    if os.environ.get("PAGEFLEET_KMOCK_AS_IS"):
        return False
    try:
        from kmock._internal import dsl, filtering, rendering
    except ImportError:
        return False
    view_cls = getattr(dsl, "View", None)
    filter_cls = getattr(dsl, "Filter", None)
    priority_cls = getattr(dsl, "Priority", None)
    root_cls = getattr(dsl, "Root", None)
    request_cls = getattr(rendering, "Request", None)
    plain = (getattr(filtering, "K8sCriteria", None), getattr(filtering, "HTTPCriteria", None))
    if None in (view_cls, filter_cls, priority_cls, root_cls, request_cls) or None in plain:
        return False
    original = view_cls.__dict__.get("__contains__")
    if original is None or getattr(original, "_pagefleet", False):
        return False
    root_iter = root_cls.__dict__["__iter__"]

    def __contains__(self, item) -> bool:
        if not isinstance(item, request_cls):
            return original(self, item)
        view = self
        while True:
            cls = type(view)
            if cls is filter_cls and type(view.criteria) in plain:
                if not view.criteria(item):
                    return False
                view = view._source
            elif cls is priority_cls:
                view = view._source
            elif isinstance(view, root_cls) and cls.__iter__ is root_iter and cls.__contains__ is __contains__:
                return any(request is item for request in reversed(view._requests))
            elif cls.__contains__ is __contains__:
                return original(view, item)
            else:
                return item in view

    __contains__._pagefleet = True
    view_cls.__contains__ = __contains__
    return True
