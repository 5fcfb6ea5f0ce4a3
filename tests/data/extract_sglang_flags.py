"""Regenerate sglang_0.5.23_flags.txt from an SGLang wheel (not run by the test suite).

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl
    cd /tmp/sgl && python -m zipfile -e sglang-0.5.23-*.whl w
    python -m venv venv && venv/bin/pip install msgspec numpy packaging
    venv/bin/python extract_sglang_flags.py /tmp/sgl/w > sglang_0.5.23_flags.txt.body

It builds SGLang's real `launch_server` argument parser (`ServerArgs.add_cli_args`, the same call
`prepare_server_args` makes) and prints every `--option` string, aliases included. Heavy optional
dependencies (torch, transformers, triton, ...) are replaced by inert stub modules: they are
imported by the package but take no part in declaring the flags.
"""

from __future__ import annotations

import abc
import argparse
import importlib.abc
import importlib.machinery
import sys
import types

REAL = {"sglang", "msgspec", "argparse", "numpy", "packaging"}
_NOT_STUBBED = {
    "__origin__", "__args__", "__parameters__", "__wrapped__", "__signature__",
    "__text_signature__", "__func__", "__self__", "__isabstractmethod__", "__mro_entries__",
    "__set_name__", "__get__", "__objclass__",
}


class _Meta(abc.ABCMeta):
    def __getattr__(cls, name):
        if name in _NOT_STUBBED:
            raise AttributeError(name)
        return _Meta(name, (_Stub,), {})

    def __call__(cls, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]  # used as a decorator
        return _Meta("inst", (_Stub,), {})

    def __getitem__(cls, k):
        return cls

    def __or__(cls, o):
        return cls

    __ror__ = __or__

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return True

    def __int__(cls):
        return 0

    def __lt__(cls, o):
        return False

    __gt__ = __le__ = __ge__ = __lt__


class _Stub(metaclass=_Meta):
    pass


class _StubModule(types.ModuleType):
    __version__ = "2.14.0"

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Stub,), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in REAL:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            try:
                if finder.find_spec(name, path, target) is not None:
                    return None
            except Exception:
                continue
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__file__ = "/nonexistent/" + spec.name.replace(".", "/") + "/__init__.py"
        return module

    def exec_module(self, module):
        pass


def main(wheel_dir: str) -> None:
    sys.path.insert(0, wheel_dir)
    sys.meta_path.append(_StubFinder())
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    for option in sorted(o for o in parser._option_string_actions if o.startswith("--")):
        print(option)


if __name__ == "__main__":
    main(sys.argv[1])
