"""The family registry: ``algorithm`` name -> :class:`speculators.drafters.base.Drafter` subclass.

A leaf module (it imports only the errors module), so that every module of the package can find a family
by name without importing the drafter interface: :func:`register` is the class decorator each family file
applies, :data:`registry` the lookup (``registry.get(name)``, ``registry.names()``). Importing
:mod:`speculators.drafters` registers every family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SpeculatorsError

if TYPE_CHECKING:
    from .base import Drafter

_REGISTRY: dict[str, type[Drafter]] = {}


def register(cls: type[Drafter]) -> type[Drafter]:
    """Class decorator: make a family available under ``cls.algorithm``.

    Raises:
        SpeculatorsError: the family's serving format (``cls.serving``) formats another family
            (its ``algorithm`` differs from the drafter's).
    """
    fmt = getattr(cls, "serving", None)
    if fmt is not None and fmt.algorithm != cls.algorithm:
        raise SpeculatorsError(f"{cls.__name__}.serving formats {fmt.algorithm!r}, not {cls.algorithm!r}: "
                               f"give the family its own ServingFormat subclass with algorithm = {cls.algorithm!r}")
    _REGISTRY[cls.algorithm] = cls
    return cls


class _Registry:
    """Lookup of the registered families (the one instance is :data:`registry`)."""

    def names(self) -> list[str]:
        """The registered ``algorithm`` names, sorted."""
        return sorted(_REGISTRY)

    def get(self, name: str) -> type[Drafter]:
        """The drafter class registered under ``name``.

        Raises:
            SpeculatorsError: no family of that name, naming the allowed ones.
        """
        try:
            return _REGISTRY[name]
        except KeyError:
            raise SpeculatorsError(f"unknown drafter algorithm {name!r}; allowed: {self.names()}") from None


registry = _Registry()

__all__ = ["register", "registry"]
