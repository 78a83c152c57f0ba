"""One exception base (issue 58 point 5): every error class zerokld raises on purpose is a ``ZeroKLDError``, a client
error (HTTP 4xx) or a server error (5xx), and keeps the builtin it always was, so existing ``except`` clauses hold."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from zerokld_plugins.errors import ZeroKLDClientError, ZeroKLDError, ZeroKLDServerError

PACKAGES = ("shared_numerics", "deltasync", "zerokld_models", "zerokld_plugins", "titan_plugin", "vllm_plugin")


def _error_classes():
    found = {}
    for name in PACKAGES:
        pkg = importlib.import_module(name)
        for info in pkgutil.walk_packages(pkg.__path__, f"{name}."):
            if info.name.endswith(("__main__", "ops_triton.kernels")) or ".ops_triton" in info.name:
                continue
            mod = importlib.import_module(info.name)
            for cls_name, cls in inspect.getmembers(mod, inspect.isclass):
                if cls.__module__ == info.name and issubclass(cls, BaseException):
                    found[f"{info.name}.{cls_name}"] = cls
    return found


def test_every_error_class_has_the_base_and_keeps_its_builtin():
    classes = _error_classes()
    assert len(classes) >= 20
    assert [
        n for n, c in classes.items() if not issubclass(c, ZeroKLDError) and c.__module__ != "zerokld_plugins.errors"
    ] == []
    for name, cls in classes.items():
        if cls in (ZeroKLDError, ZeroKLDClientError, ZeroKLDServerError) or cls.__name__ == "HotLoadError":
            continue
        assert issubclass(cls, (ZeroKLDClientError, ZeroKLDServerError)), name
        assert any(b in cls.__mro__ for b in (ValueError, KeyError, RuntimeError, OSError)), name


def test_status_codes():
    from deltasync.protocol import HotLoadError
    from shared_numerics.fp8 import Fp8QuantizationError
    from shared_numerics.mode import NumericsMismatchError
    from titan_plugin.training_server import BodyTooLarge, Busy, UserError

    assert Fp8QuantizationError("x").status_code == 400 and NumericsMismatchError("x").status_code == 422
    assert (UserError("x").status_code, BodyTooLarge("x").status_code, Busy("x").status_code) == (400, 413, 429)
    assert HotLoadError("x", 507).status_code == 507 and isinstance(HotLoadError("x"), ZeroKLDError)
    with pytest.raises(ValueError):  # still caught as the builtin it was
        raise Fp8QuantizationError("non-finite")
