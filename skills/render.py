#!/usr/bin/env python3
"""Render one template of one agent skill: the single renderer for every skill under skills/.

    python skills/render.py SKILL TEMPLATE [--values FILE.yaml ...] [--set KEY=VALUE ...]
                            [--set-str KEY=VALUE ...] [--set-file KEY=FILE.json|yaml ...] [--output FILE]
    python skills/render.py SKILL --list            # templates of SKILL and the variables each one needs

TEMPLATE is a file name under skills/SKILL/templates/ with or without its `.j2` suffix. Values are
merged in order: every --values file, then --set-file, --set and --set-str (later wins). --set parses
its value as a YAML scalar or flow collection (`4`, `true`, `[1, 4]`); --set-str keeps it as text;
--set-file loads a JSON/YAML document (for example `profile-analyzer report --format json` output).
Dotted keys (`server.port=8000`) build nested mappings.

Every variable a template references must be given: the renderer lists the template's free variables
before rendering and renders with StrictUndefined, so a forgotten value is an error, not an empty
string in a launch script. The rendered text is checked by the kind of file it is (bash -n for shell
scripts, compile() for Python, yaml/json parsing) before anything is written; the output is written to
a temporary file and renamed into place, so a failure never leaves a partial file. Bad input prints
one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SKILLS_DIR = Path(__file__).resolve().parent
TEMPLATE_SUFFIX = ".j2"


class RenderError(Exception):
    """A user error: bad skill, template, value or output; the message is one line."""


def _require_libraries() -> tuple[Any, Any]:
    try:
        import jinja2
        import yaml
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the interpreter used
        raise RenderError(f"render.py needs the package {exc.name!r}: pip install jinja2 pyyaml") from None
    return jinja2, yaml


def skill_names() -> list[str]:
    """The skills: folders of skills/ that hold a SKILL.md."""
    return sorted(p.name for p in SKILLS_DIR.iterdir() if (p / "SKILL.md").is_file())


def template_names(skill: str) -> list[str]:
    """Template names of `skill` (file names below templates/, without the .j2 suffix)."""
    root = SKILLS_DIR / skill / "templates"
    if not root.is_dir():
        return []
    return sorted(
        str(p.relative_to(root))[: -len(TEMPLATE_SUFFIX)] for p in root.rglob(f"*{TEMPLATE_SUFFIX}") if p.is_file()
    )


def _template_path(skill: str, template: str) -> Path:
    if skill not in skill_names():
        raise RenderError(f"unknown skill {skill!r}; accepted: {', '.join(skill_names())}")
    name = template[: -len(TEMPLATE_SUFFIX)] if template.endswith(TEMPLATE_SUFFIX) else template
    names = template_names(skill)
    by_stem = [n for n in names if n.split(".", 1)[0] == name]
    if name not in names and len(by_stem) == 1:  # `matrix` for `matrix.yaml`
        name = by_stem[0]
    if name not in names:
        raise RenderError(f"unknown template {template!r} of skill {skill}; accepted: {', '.join(names) or '(none)'}")
    return SKILLS_DIR / skill / "templates" / (name + TEMPLATE_SUFFIX)


def _shquote(value: Any) -> str:
    return shlex.quote(str(value))


def _cli_args(mapping: dict[str, Any] | None) -> str:
    """`{"max-model-len": 512, "enforce-eager": true}` -> `--max-model-len 512 --enforce-eager` (shell-quoted)."""
    parts: list[str] = []
    for key, value in (mapping or {}).items():
        flag = "--" + str(key).lstrip("-")
        if value is True:
            parts.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, dict):
            parts += [flag, shlex.quote(json.dumps(value, separators=(",", ":")))]
        elif isinstance(value, list):
            parts += [flag] + [shlex.quote(str(v)) for v in value]
        else:
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)


def make_environment() -> Any:
    """The jinja2 environment all skill templates share (StrictUndefined, shell/JSON helpers)."""
    jinja2, _ = _require_libraries()
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(SKILLS_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["shquote"] = _shquote
    env.filters["cli_args"] = _cli_args
    env.filters["pyrepr"] = repr
    env.filters["fmt"] = lambda value, spec="": format(value, spec) if value is not None else "n/a"
    return env


def required_variables(skill: str, template: str) -> set[str]:
    """Every free variable the template (and what it includes) references."""
    jinja2, _ = _require_libraries()
    from jinja2 import meta

    env = make_environment()
    path = _template_path(skill, template)
    seen: set[str] = set()
    needed: set[str] = set()
    pending = [str(path.relative_to(SKILLS_DIR))]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        source = (SKILLS_DIR / name).read_text(encoding="utf-8")
        try:
            ast = env.parse(source, name=name)
        except jinja2.TemplateSyntaxError as exc:
            raise RenderError(f"template {name} line {exc.lineno}: {exc.message}") from None
        needed |= meta.find_undeclared_variables(ast)
        pending += [ref for ref in meta.find_referenced_templates(ast) if ref]
    return needed


def _parse_assignment(option: str, text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise RenderError(f"{option} {text!r}: expected KEY=VALUE (KEY may be dotted, e.g. server.port=8000)")
    return key, value


def _assign(values: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = values
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _load_document(option: str, path_text: str) -> Any:
    _, yaml = _require_libraries()
    path = Path(path_text)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RenderError(f"{option} {path_text}: cannot read ({exc.strerror or exc})") from None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RenderError(f"{option} {path_text}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} ({first})") from None


def collect_values(
    values_files: list[str], sets: list[str], set_strs: list[str], set_files: list[str]
) -> dict[str, Any]:
    """Merge --values files and --set/--set-str/--set-file assignments into one mapping."""
    _, yaml = _require_libraries()
    values: dict[str, Any] = {}
    for path_text in values_files:
        document = _load_document("--values", path_text)
        if document is None:
            continue
        if not isinstance(document, dict):
            raise RenderError(f"--values {path_text}: expected a mapping of variable names to values")
        values.update(document)
    for text in set_files:
        key, path_text = _parse_assignment("--set-file", text)
        _assign(values, key, _load_document("--set-file", path_text))
    for text in sets:
        key, raw = _parse_assignment("--set", text)
        try:
            parsed = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            parsed = raw
        _assign(values, key, parsed)
    for text in set_strs:
        key, raw = _parse_assignment("--set-str", text)
        _assign(values, key, raw)
    return values


def check_rendered(name: str, text: str) -> None:
    """Check the rendered text by the kind of file `name` is; RenderError if it is not valid."""
    _, yaml = _require_libraries()
    suffix = Path(name).suffix
    if suffix in (".sh", ".bash") or text.startswith("#!/usr/bin/env bash") or text.startswith("#!/bin/bash"):
        bash = shutil.which("bash")
        if bash is None:
            return
        proc = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["syntax error"])[0]
            raise RenderError(f"rendered {name} is not valid bash: {first}")
    elif suffix == ".py":
        try:
            compile(text, name, "exec")
        except SyntaxError as exc:
            raise RenderError(f"rendered {name} is not valid Python: line {exc.lineno}: {exc.msg}") from None
    elif suffix in (".yaml", ".yml"):
        try:
            yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RenderError(f"rendered {name} is not valid YAML: {str(exc).splitlines()[0]}") from None
    elif suffix == ".json":
        try:
            json.loads(text)
        except ValueError as exc:
            raise RenderError(f"rendered {name} is not valid JSON: {exc}") from None


def render(skill: str, template: str, values: dict[str, Any]) -> str:
    """Render `template` of `skill` with `values`; every referenced variable must be present."""
    jinja2, _ = _require_libraries()
    path = _template_path(skill, template)
    missing = sorted(required_variables(skill, template) - set(values))
    if missing:
        raise RenderError(
            f"template {skill}/{path.name} needs values for: {', '.join(missing)} (give them with --set KEY=VALUE or --values FILE)"
        )
    env = make_environment()
    try:
        text = env.get_template(str(path.relative_to(SKILLS_DIR))).render(**values)
    except jinja2.UndefinedError as exc:
        raise RenderError(f"template {skill}/{path.name}: a value has the wrong shape ({exc.message})") from None
    except jinja2.TemplateError as exc:
        raise RenderError(f"template {skill}/{path.name}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise RenderError(f"template {skill}/{path.name}: a value has the wrong shape ({type(exc).__name__}: {exc})") from None
    check_rendered(path.name[: -len(TEMPLATE_SUFFIX)], text)
    return text


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder; executable if it has a shebang."""
    if not path.parent.is_dir():
        raise RenderError(f"--output {path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o755 if text.startswith("#!") else 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="render.py", description="Render a template of an agent skill (jinja2, every variable required)."
    )
    parser.add_argument("skill", help="skill folder name under skills/")
    parser.add_argument("template", nargs="?", help="template name under SKILL/templates/ (.j2 optional)")
    parser.add_argument("--values", action="append", default=[], metavar="FILE", help="YAML/JSON file of values (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a value, parsed as YAML")
    parser.add_argument("--set-str", action="append", default=[], metavar="KEY=VALUE", help="a value, kept as text")
    parser.add_argument("--set-file", action="append", default=[], metavar="KEY=FILE", help="a value loaded from a JSON/YAML file")
    parser.add_argument("--output", "-o", metavar="FILE", help="write here (default: stdout)")
    parser.add_argument("--list", action="store_true", help="list the skill's templates and their variables")
    return parser


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # noqa: D401 - argparse hook
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.__class__ = _OneLineParser
    args = parser.parse_args(argv)
    try:
        if args.list or args.template is None:
            if args.skill not in skill_names():
                raise RenderError(f"unknown skill {args.skill!r}; accepted: {', '.join(skill_names())}")
            for name in template_names(args.skill):
                print(f"{name}: {', '.join(sorted(required_variables(args.skill, name)))}")
            return 0
        values = collect_values(args.values, args.set, args.set_str, args.set_file)
        text = render(args.skill, args.template, values)
        if args.output:
            write_atomically(Path(args.output), text)
        else:
            sys.stdout.write(text)
        return 0
    except RenderError as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
