"""Regenerate tests/data/vllm_0.33.0_flags.txt from vLLM's source, read statically (not run by the suite).

    pip download vllm==0.33.0 --no-deps -d /tmp/vl
    cd /tmp/vl && python -m zipfile -e vllm-0.33.0-*.whl src
    python3 lab/scripts/extract_vllm_flags.py /tmp/vl/src/vllm > tests/data/vllm_0.33.0_flags.txt

vLLM is not importable without torch and a GPU build, so the parser `vllm serve` builds is read
from the source's syntax tree instead of run. `vllm serve`'s parser is
`entrypoints/common/cli_args.py::make_arg_parser`: its own options, then
`FrontendArgs.add_cli_args` (one `--field-name` per dataclass field of `FrontendArgs` and
`BaseFrontendArgs`), then `AsyncEngineArgs.add_cli_args` (its own option and
`engine/arg_utils.py::EngineArgs.add_cli_args`, every `add_argument` call written out). A flag
whose config field is typed `bool` (not `bool | str | None`) gets argparse's
`BooleanOptionalAction` (`engine/arg_utils.py::_compute_kwargs`), so its `--no-` form too; so does
an explicit `action=argparse.BooleanOptionalAction`. Every branch counts (a flag added under an
`if` is a flag). Platform and plugin hooks (`current_platform.pre_register_and_update`,
`load_general_plugins`) add nothing on CUDA without plugins and are not read.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

HEADER = """\
# Every command-line option of `vllm serve` in vLLM 0.33.0 (the pinned release), `--help` included.
#
# Source: the PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
#   (https://pypi.org/project/vllm/0.33.0/, fetched with `pip download vllm==0.33.0 --no-deps`,
#   sha256 4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa).
# Extracted by lab/scripts/extract_vllm_flags.py, which reads the parser `vllm serve` builds
#   (vllm/entrypoints/common/cli_args.py::make_arg_parser: FrontendArgs.add_cli_args and
#   vllm/engine/arg_utils.py::AsyncEngineArgs.add_cli_args) from the source's syntax tree:
#   `python3 lab/scripts/extract_vllm_flags.py <unpacked wheel>/vllm`.
"""


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _classes(root: Path) -> dict[str, ast.ClassDef]:
    """The classes the parser is built from, by name: the config classes (config/), the engine's
    and the frontend's arguments."""
    found: dict[str, ast.ClassDef] = {}
    files = [*sorted(root.joinpath("config").rglob("*.py")), root / "engine" / "arg_utils.py",
             root / "entrypoints" / "common" / "cli_args.py"]
    for path in files:
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, node)
    return found


def _fields(classes: dict[str, ast.ClassDef], name: str) -> dict[str, ast.expr]:
    """A dataclass's fields (annotation by name), its bases' first, ClassVar left out."""
    cls = classes[name]
    fields: dict[str, ast.expr] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(_fields(classes, base.id))
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if "ClassVar" not in ast.unparse(node.annotation):
                fields[node.target.id] = node.annotation
    return fields


def _type_names(annotation: ast.expr) -> set[str]:
    """The names a field's annotation is a union of (`bool | None` -> {bool, None})."""
    text = ast.unparse(annotation)
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _type_names(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _type_names(annotation.left) | _type_names(annotation.right)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in ("Optional", "Union"):
        inner = annotation.slice
        parts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
        names = {"None"} if ast.unparse(annotation.value) == "Optional" else set()
        for part in parts:
            names |= _type_names(part)
        return names
    return {text}


def _is_boolean_optional(annotation: ast.expr) -> bool:
    """_compute_kwargs: bool -> BooleanOptionalAction, but {bool, str, None} -> nargs='?'."""
    names = _type_names(annotation)
    return "bool" in names and names != {"bool", "str", "None"}


def _options(call: ast.Call) -> list[str]:
    return [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
            and a.value.startswith("--")]


def _with_negations(options: list[str], boolean: bool) -> Iterator[str]:
    yield from options
    if boolean:
        yield from ("--no-" + option[2:] for option in options)


def _kwargs_sources(func: ast.FunctionDef) -> dict[str, tuple[str, str | None]]:
    """`x_kwargs = get_kwargs(Cls)` -> {x_kwargs: (Cls, None)}; `= get_kwargs(Cls)["f"]` -> (Cls, f)."""
    sources: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(func):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            continue
        value, field = node.value, None
        if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant):
            value, field = value.value, str(value.slice.value)
        if (isinstance(value, ast.Call) and ast.unparse(value.func) == "get_kwargs"
                and isinstance(value.args[0], ast.Name)):
            sources[node.targets[0].id] = (value.args[0].id, field)
    return sources


def _explicit_flags(func: ast.FunctionDef, classes: dict[str, ast.ClassDef]) -> Iterator[str]:
    """Every `add_argument("--x", ...)` in a function, with `--no-x` where argparse adds it."""
    sources = _kwargs_sources(func)
    for node in ast.walk(func):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        options = _options(node)
        boolean = False
        for keyword in node.keywords:
            if keyword.arg == "action":
                boolean = ast.unparse(keyword.value) == "argparse.BooleanOptionalAction"
            elif keyword.arg is None:  # **x_kwargs["field"], **x_kwargs, **{**x_kwargs["field"], ...}
                spread = keyword.value
                unpacked = ([v for k, v in zip(spread.keys, spread.values, strict=True) if k is None]
                            if isinstance(spread, ast.Dict) else [spread])
                for value in unpacked:
                    field = None
                    if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant):
                        value, field = value.value, str(value.slice.value)
                    if isinstance(value, ast.Name) and value.id in sources:
                        cls, sourced = sources[value.id]
                        field = field or sourced
                        if field is not None:
                            boolean = _is_boolean_optional(_fields(classes, cls)[field])
        yield from _with_negations(options, boolean)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    (found,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return found


def flags(root: Path) -> list[str]:
    classes = _classes(root)
    cli_args = _parse(root / "entrypoints" / "common" / "cli_args.py")
    (make_arg_parser,) = [n for n in cli_args.body if isinstance(n, ast.FunctionDef)
                          and n.name == "make_arg_parser"]
    out = {"--help"}
    out.update(_explicit_flags(make_arg_parser, classes))
    for field, annotation in _fields(classes, "FrontendArgs").items():
        out.update(_with_negations(["--" + field.replace("_", "-")], _is_boolean_optional(annotation)))
    out.update(_explicit_flags(_method(classes["EngineArgs"], "add_cli_args"), classes))
    out.update(_explicit_flags(_method(classes["AsyncEngineArgs"], "add_cli_args"), classes))
    return sorted(out)


def main(root: str) -> None:
    sys.stdout.write(HEADER + "".join(flag + "\n" for flag in flags(Path(root))))


if __name__ == "__main__":
    main(sys.argv[1])
