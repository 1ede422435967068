"""A module class whose ``__call__`` runs with some global names bound otherwise.

mlx-lm's model files call functions and constants hard-coded in ``__call__``
(``nn.gelu(x)``, ``rms_norm(x)`` with eps 1e-5, ``mx.array(s, mx.bfloat16)``). Where the
config asks for another value, `with_globals` makes a subclass whose ``__call__`` is
the same code with those globals replaced (`Namespace` replaces attributes of a module
such as ``nn`` or ``mx``); `rebind` gives the modules of a built model that class.
Parameters, module paths and the type name stay as they were.
"""

from __future__ import annotations

import types
from typing import Any

_MADE: dict[tuple, type] = {}


class Namespace(types.ModuleType):
    """A module (``mlx.nn``) with some names replaced."""

    def __init__(self, module: types.ModuleType, replaced: dict[str, Any]):
        super().__init__(module.__name__)
        self._module = module
        self.__dict__.update(replaced)

    def __getattr__(self, attr: str):
        return getattr(self._module, attr)


def call_code(cls):
    """The code object of the ``__call__`` a class runs."""
    owner = next((c for c in cls.__mro__ if "__call__" in vars(c)), None)
    return getattr(vars(owner)["__call__"], "__code__", None) if owner else None


def with_globals(cls, replaced: dict[str, Any], key: Any = None) -> type:
    """A subclass of ``cls`` whose ``__call__`` sees ``replaced`` as globals (cached
    by ``key``, when given)."""
    if key is not None and (cls, key) in _MADE:
        return _MADE[(cls, key)]
    owner = next(c for c in cls.__mro__ if "__call__" in vars(c))
    call = vars(owner)["__call__"]
    scope = {**call.__globals__, **replaced}
    body = types.FunctionType(call.__code__, scope, call.__name__, call.__defaults__,
                              call.__closure__)
    body.__kwdefaults__ = call.__kwdefaults__
    sub = type(cls.__name__, (cls,), {"__call__": body, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__, "_yeto_rebound": True})
    if key is not None:
        _MADE[(cls, key)] = sub
    return sub


def rebind(model, module_name: str, replaced: dict[str, Any], key: Any) -> list[str]:
    """Every module of ``model`` whose class, defined in ``module_name``, calls one of
    the ``replaced`` names, given `with_globals`; returns the class names."""
    done = set()
    for _, m in model.named_modules():
        cls = type(m)
        code = call_code(cls)
        if (cls.__module__ != module_name or vars(cls).get("_yeto_rebound")
                or code is None or not set(code.co_names) & set(replaced)):
            continue
        m.__class__ = with_globals(cls, replaced, key)
        done.add(cls.__name__)
    return sorted(done)
