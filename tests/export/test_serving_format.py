"""Each family's serving format (``Drafter.serving``): its own ServingFormat subclass, formatting that family,
and ``register`` refuses a drafter whose format names another family."""

from __future__ import annotations

import pytest

from speculators.drafters import Drafter, ServingFormat, registry
from speculators.drafters.registry import register
from speculators.errors import SpeculatorsError


@pytest.mark.parametrize("algorithm", registry.names())
def test_every_family_declares_its_own_serving_format(algorithm):
    family = registry.get(algorithm)
    fmt = family.serving
    assert isinstance(fmt, ServingFormat) and type(fmt) is not ServingFormat
    assert fmt.algorithm == family.algorithm == algorithm
    # the format lives in the family's file, beside the drafter, or in its own ``<family file>_format`` module
    assert type(fmt).__module__ in (family.__module__, family.__module__ + "_format")


def test_register_refuses_a_format_of_another_family():
    other = registry.get(registry.names()[0])
    before = registry.names()

    class Mismatched(Drafter):
        algorithm = "not-" + other.algorithm
        serving = other.serving

    with pytest.raises(SpeculatorsError, match=rf"formats {other.algorithm!r}, not 'not-{other.algorithm}'"):
        register(Mismatched)
    assert registry.names() == before
