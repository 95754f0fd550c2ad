"""``delegated``: a property that forwards to an attribute of an attribute.

Front-ends expose the runtime's objects under their own public names
(``reducer.dense`` is ``reducer.settings.dense``, ``optimizer.stats`` is the
training exchange's ``stats``). One descriptor per name replaces a getter and
a setter written out for each.
"""
from __future__ import annotations

from typing import Any, Callable


class delegated:  # noqa: N801 - used like ``property``
    """A property reading ``obj.<path>`` (a dotted path) and, if writable, setting it.

    ``convert`` is applied to assigned values (``bool``, ``int``, ``float``);
    giving one makes the property writable, as does ``writable=True`` (values
    then stored as they are). Without either, assignment raises
    ``AttributeError`` as for a read-only ``property``.
    """

    def __init__(self, path: str, doc: str, convert: Callable[[Any], Any] | None = None, *,
                 writable: bool | None = None) -> None:
        self.head, _, self.last = path.rpartition(".")
        self.convert = convert
        self.writable = convert is not None if writable is None else writable
        self.__doc__ = doc
        self.name = path

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def _owner_of_last(self, obj: Any) -> Any:
        for part in self.head.split(".") if self.head else ():
            obj = getattr(obj, part)
        return obj

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(self._owner_of_last(obj), self.last)

    def __set__(self, obj: Any, value: Any) -> None:
        if not self.writable:
            raise AttributeError(f"{self.name} is read-only")
        if self.convert is not None:
            value = self.convert(value)
        setattr(self._owner_of_last(obj), self.last, value)
