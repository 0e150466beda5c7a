"""Write docs/configuration.md: every field of every tier's config, from the config classes.

Each field's dot path, type, default and description (its attribute docstring, read from
the class's source), one table per tier command, nested models flattened into dot paths
(``optim.lr``) and each variant of a union (the engines) in a table of its own. Needs
every Laminar package installed (the integration env has them).

    python tools/config_reference.py            # writes docs/configuration.md
    python tools/config_reference.py --check    # exit 1 if the file is not what it writes
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

OUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _tiers() -> list[tuple[str, type[BaseModel]]]:
    from laminar_common.launch.jobfile import JobFile
    from laminar_relay.config import RelayConfig
    from laminar_rollout.config import ManagerConfig, WorkerConfig
    from laminar_trainer.config import TrainerConfig

    return [("laminar-trainer run", TrainerConfig), ("laminar-rollout serve", WorkerConfig),
            ("laminar-rollout manage", ManagerConfig), ("laminar-relay serve", RelayConfig),
            ("laminar up JOB (the job file)", JobFile)]


def attribute_docs(model: type[BaseModel]) -> dict[str, str]:
    """The docstring under each field of ``model`` and its bases (``field: T = x`` then a
    string), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                    isinstance(after.value.value, str):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The config models an annotation holds (a model, an optional one, a union of them)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def _type_name(annotation: object) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    text = str(annotation).replace("typing.", "")
    for prefix in ("laminar_common.", "laminar_relay.", "laminar_rollout.", "laminar_trainer."):
        while prefix in text:
            start = text.index(prefix)
            end = start
            while end < len(text) and (text[end].isalnum() or text[end] in "._"):
                end += 1
            text = text[:start] + text[start:end].rsplit(".", 1)[-1] + text[end:]
    return text


def _default(field) -> str:
    if field.default_factory is not None:
        return "(computed)"
    if field.default is PydanticUndefined:
        return "**required**"
    value = field.default
    if isinstance(value, BaseModel):
        return "(the defaults below)"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def tables(title: str, model: type[BaseModel]) -> list[str]:
    """Markdown for ``model``: its flattened fields, then each union variant's table."""
    rows: list[str] = []
    variants: list[tuple[str, type[BaseModel]]] = []

    def walk(m: type[BaseModel], prefix: str) -> None:
        docs = attribute_docs(m)
        for name, field in m.model_fields.items():
            path = prefix + name
            models = _models_in(field.annotation)
            rows.append(f"| `{path}` | {_cell(_type_name(field.annotation))} | "
                        f"{_cell(_default(field))} | {_cell(docs.get(name, ''))} |")
            if len(models) == 1:
                walk(models[0], path + ".")
            elif models:
                variants.extend((path, v) for v in models)
            elif typing.get_origin(field.annotation) is dict:  # e.g. the job file's tiers
                values = _models_in(typing.get_args(field.annotation)[1])
                if len(values) == 1:
                    walk(values[0], path + ".<name>.")

    walk(model, "")
    out = [f"## `{title}` ({model.__name__})", "", _cell(inspect.getdoc(model) or ""), "",
           "| field | type | default | what it is |", "|---|---|---|---|", *rows, ""]
    for path, variant in variants:
        out += [f"### `{path}` as {variant.__name__}", "",
                _cell(inspect.getdoc(variant) or ""), "",
                "| field | type | default | what it is |", "|---|---|---|---|"]
        sub: list[str] = []
        docs = attribute_docs(variant)
        for name, field in variant.model_fields.items():
            sub.append(f"| `{path}.{name}` | {_cell(_type_name(field.annotation))} | "
                       f"{_cell(_default(field))} | {_cell(docs.get(name, ''))} |")
        out += [*sub, ""]
    return out


def render() -> str:
    head = ["# Configuration reference", "",
            "Every field of every tier's config, generated from the config classes by "
            "`python tools/config_reference.py` (`integration_tests/test_config_reference.py` "
            "checks that this file is what it writes). A tier reads them from `--config FILE` "
            "(YAML or TOML), `LAMINAR_A__B=value` variables and `--set a.b=value`, in that "
            "order of precedence; a job file gives each tier's under `tiers.NAME.config`.", ""]
    body = [line for title, model in _tiers() for line in tables(title, model)]
    return "\n".join(head + body).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/configuration.md differs from what this writes")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python tools/config_reference.py",
                  file=sys.stderr)
            return 1
        print(f"{OUT} is up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
