"""What the kopf handlers ask of kopf: no finalizer for the children's cleanup
(owner references already garbage-collect them)."""

from __future__ import annotations

import kopf

from pagefleet.operator import handlers


def test_delete_handler_needs_no_finalizer() -> None:
    registry = kopf.get_default_registry()
    (delete,) = [h for h in registry._changing.get_all_handlers() if h.fn is handlers.delete]
    assert delete.requires_finalizer is False
    # The one reason left: kopf stops a daemon before its object goes (docs/operator.md).
    needing = {h.id for h in registry._spawning.get_all_handlers() if h.requires_finalizer}
    assert needing == {"autoscaler"}
