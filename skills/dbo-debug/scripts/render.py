#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = ["jinja2>=3.1", "pyyaml>=6"]
# ///
"""Render one template of the agent skill this file belongs to.

    python scripts/render.py TEMPLATE [--example] [--values FILE.yaml ...] [--set KEY=VALUE ...]
                             [--set-str KEY=VALUE ...] [--set-file KEY=FILE.json|yaml ...] [-o FILE]
    python scripts/render.py --list      # the skill's templates and the variables each one needs

The skill is the folder above this script's folder (the one holding SKILL.md); `--skill DIR` names
another. TEMPLATE is a file under the skill's assets/ with or without its `.j2` suffix, or its stem
(`launch_server` for `launch_server.sh.j2`). Values are merged in order: the template's example values
(assets/<stem>.values.yaml, with --example), every --values file, then --set-file, --set and --set-str
(later wins). --set parses its value as YAML (`4`, `true`, `[1, 4]`); --set-str keeps it as text;
--set-file loads a JSON/YAML document (for example `profile-analyzer report --format json` output).
Dotted keys (`server.port=8000`) build nested mappings. Relative paths are read from the current
folder, and the output is written there, never into the skill.

Overrides: `--set KEY=VALUE` replaces one variable (`--set tensor_parallel_size=2`); a dotted KEY sets one
entry of a mapping variable and keeps the others (`--set extra_args.max-num-seqs=24` adds the server
flag `--max-num-seqs 24`; `--set-str extra_env.ASCEND_RT_VISIBLE_DEVICES=0,1` sets one environment
variable). `--list` names the variables; a flag that is not a variable goes into the mapping that holds
flags (`extra_args` in the launch templates). Templates check values that must agree (for example
tensor x data parallel size against the visible devices) and stop with one line saying what to change.

Every variable the template references must be given: a forgotten value is an error, not an empty
string in a launch script. The rendered text is checked by its kind (bash -n for shell, compile() for
Python, YAML/JSON parsing) before anything is written, and it is written through a temporary file, so
a failure never leaves a partial file. Bad input prints one line on stderr and exits 2.

This file has one source in the repository (skills/render.py); every skill's scripts/render.py is an
identical copy written by `make skills-sync`.
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
import textwrap
from pathlib import Path
from typing import Any

TEMPLATE_SUFFIX = ".j2"
VALUES_SUFFIX = ".values.yaml"
TEMPLATE_FOLDER = "assets"


class RenderError(Exception):
    """A user error: bad skill, template, value or output; the message is one line."""


class TemplateCheckFailed(Exception):
    """Raised by `fail(message)` inside a template: values that contradict each other."""


def _fail(message: str) -> str:
    raise TemplateCheckFailed(" ".join(str(message).split()))


def _require_libraries() -> tuple[Any, Any]:
    try:
        import jinja2
        import yaml
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the interpreter used
        raise RenderError(f"render.py needs the package {exc.name!r}: pip install jinja2 pyyaml") from None
    return jinja2, yaml


def default_skill_dir() -> Path:
    """The skill this copy belongs to: the folder above scripts/."""
    return Path(__file__).resolve().parent.parent


def skill_root(skill_dir: Path | str | None = None) -> Path:
    """The skill folder (holding SKILL.md), or RenderError."""
    root = Path(skill_dir).resolve() if skill_dir is not None else default_skill_dir()
    if not (root / "SKILL.md").is_file():
        raise RenderError(f"--skill {root}: no SKILL.md there (give the folder of a skill)")
    return root


def template_names(skill_dir: Path) -> list[str]:
    """Template names of the skill (files below assets/ ending in .j2, without the suffix)."""
    root = Path(skill_dir) / TEMPLATE_FOLDER
    if not root.is_dir():
        return []
    return sorted(
        str(p.relative_to(root))[: -len(TEMPLATE_SUFFIX)] for p in root.rglob(f"*{TEMPLATE_SUFFIX}") if p.is_file()
    )


def template_path(skill_dir: Path, template: str) -> Path:
    """assets/<template>.j2 of the skill; accepts the name with or without .j2, or its stem."""
    name = template[: -len(TEMPLATE_SUFFIX)] if template.endswith(TEMPLATE_SUFFIX) else template
    name = name.removeprefix(TEMPLATE_FOLDER + "/")
    names = template_names(skill_dir)
    by_stem = [n for n in names if n.split(".", 1)[0] == name]
    if name not in names and len(by_stem) == 1:
        name = by_stem[0]
    if name not in names:
        raise RenderError(
            f"unknown template {template!r} of skill {Path(skill_dir).name}; accepted: {', '.join(names) or '(none)'}"
        )
    return Path(skill_dir) / TEMPLATE_FOLDER / (name + TEMPLATE_SUFFIX)


def example_values_path(skill_dir: Path, template: str) -> Path:
    """assets/<stem>.values.yaml: the complete example values of a template."""
    path = template_path(skill_dir, template)
    return path.parent / (path.name.split(".", 1)[0] + VALUES_SUFFIX)


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


def make_environment(skill_dir: Path) -> Any:
    """The jinja2 environment of the skill's templates (StrictUndefined, shell/Python/JSON quoting filters)."""
    jinja2, _ = _require_libraries()
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(skill_dir) / TEMPLATE_FOLDER)),
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
    env.globals["fail"] = _fail
    return env


def required_variables(skill_dir: Path, template: str) -> set[str]:
    """Every free variable the template (and what it includes) references."""
    jinja2, _ = _require_libraries()
    from jinja2 import meta

    env = make_environment(skill_dir)
    assets = Path(skill_dir) / TEMPLATE_FOLDER
    path = template_path(skill_dir, template)
    seen: set[str] = set()
    needed: set[str] = set()
    pending = [str(path.relative_to(assets))]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        source = (assets / name).read_text(encoding="utf-8")
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
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise RenderError(f"{option} {path_text}: not valid {kind} ({first})") from None


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
    if suffix in (".sh", ".bash") or text.startswith(("#!/usr/bin/env bash", "#!/bin/bash")):
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


def render(skill_dir: Path, template: str, values: dict[str, Any]) -> str:
    """Render `template` of the skill in `skill_dir` with `values`; every referenced variable must be present."""
    jinja2, _ = _require_libraries()
    path = template_path(skill_dir, template)
    label = f"{Path(skill_dir).name}/{path.name}"
    missing = sorted(required_variables(skill_dir, template) - set(values))
    if missing:
        raise RenderError(
            f"template {label} needs values for: {', '.join(missing)} "
            "(give them with --example, --values FILE or --set KEY=VALUE)"
        )
    env = make_environment(skill_dir)
    try:
        text = env.get_template(str(path.relative_to(Path(skill_dir) / TEMPLATE_FOLDER))).render(**values)
    except TemplateCheckFailed as exc:
        raise RenderError(f"{label}: {exc}") from None
    except jinja2.UndefinedError as exc:
        raise RenderError(f"template {label}: a value has the wrong shape ({exc.message})") from None
    except jinja2.TemplateError as exc:
        raise RenderError(f"template {label}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise RenderError(f"template {label}: a value has the wrong shape ({type(exc).__name__}: {exc})") from None
    check_rendered(path.name[: -len(TEMPLATE_SUFFIX)], text)
    return text


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder; executable if it has a shebang."""
    path = Path(path)
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


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # noqa: D401 - argparse hook
        self.exit(2, f"{self.prog}: {message}\n")


def _example_override(values: dict[str, Any]) -> list[str]:
    """`--set`/`--set-str` options that show the override syntax with this template's own example values."""
    options = []
    scalar = next(((k, v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)), None)
    if scalar:
        options.append(f"--set {scalar[0]}={scalar[1]}")
    nested = next(((k, v) for k, v in values.items() if isinstance(v, dict) and v), None)
    if nested:
        key, value = next(iter(nested[1].items()))
        option = "--set-str" if isinstance(value, str) else "--set"
        text = json.dumps(value) if isinstance(value, (bool, list, dict)) or value is None else str(value)
        options.append(f"{option} {nested[0]}.{key}={shlex.quote(text)}")
    return options


HELP_EXAMPLE_PREFIX = "# help-example:"


def _declared_examples(values_path: Path) -> list[str]:
    """Options given on `# help-example: OPTIONS` lines of a values file (what --help shows for it)."""
    if not values_path.is_file():
        return []
    return [line[len(HELP_EXAMPLE_PREFIX):].strip() for line in values_path.read_text(encoding="utf-8").splitlines()
            if line.startswith(HELP_EXAMPLE_PREFIX)]


def help_examples(skill_dir: Path | None = None) -> str:
    """The Examples section of --help: commands that run as they are in this skill (a test executes them).

    Per template: rendering its example values; then the `# help-example:` lines of its values file, or
    else one override built from its own example values (a number with --set, a mapping entry with a dotted key).
    """
    lines = ["Examples (from the skill's folder; elsewhere prefix scripts/ with that folder):",
             "  python scripts/render.py --list"]
    try:
        root = skill_root(skill_dir)
        names = template_names(root)
    except RenderError:
        return "\n".join(lines)
    _, yaml = _require_libraries()
    for name in names:
        stem, output = name.split(".", 1)[0], Path(name).name
        lines.append(f"  python scripts/render.py {stem} --example -o {output}")
        values_path = example_values_path(root, name)
        declared = _declared_examples(values_path)
        if not declared and values_path.is_file():
            values = yaml.safe_load(values_path.read_text(encoding="utf-8")) or {}
            options = _example_override(values) if isinstance(values, dict) else []
            declared = [" ".join(options)] if options else []
        lines += [f"  python scripts/render.py {stem} --example {options} -o {output}" for options in declared]
    return "\n".join(lines)


def build_parser(skill_dir: Path | None = None) -> argparse.ArgumentParser:
    try:
        epilog = help_examples(skill_dir)
    except RenderError:
        epilog = ""
    parser = _OneLineParser(
        prog="render.py",
        description="Render a template of this agent skill (jinja2; every variable must be given).",
        epilog=epilog + "\n\n" + textwrap.fill(
            "Overrides: " + " ".join((__doc__ or "").split("Overrides: ", 1)[-1].split("\n\n", 1)[0].split()), 100),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("template", nargs="?", help="template under the skill's assets/ (.j2 optional, or its stem)")
    parser.add_argument("--example", action="store_true", help="start from the template's example values")
    parser.add_argument("--values", action="append", default=[], metavar="FILE", help="YAML/JSON file of values (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a value, parsed as YAML; a dotted KEY sets one entry of a mapping (extra_args.max-num-seqs=24)")
    parser.add_argument("--set-str", action="append", default=[], metavar="KEY=VALUE",
                        help="a value, kept as text (extra_env.ASCEND_RT_VISIBLE_DEVICES=0,1)")
    parser.add_argument("--set-file", action="append", default=[], metavar="KEY=FILE", help="a value loaded from a JSON/YAML file")
    parser.add_argument("--output", "-o", metavar="FILE", help="write here (default: stdout)")
    parser.add_argument("--list", action="store_true", help="list the templates and their variables")
    parser.add_argument("--skill", metavar="DIR", help="the skill folder (default: the folder above this script)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        root = skill_root(args.skill)
        if args.list or args.template is None:
            for name in template_names(root):
                print(f"{name}: {', '.join(sorted(required_variables(root, name)))}")
            return 0
        examples = [str(example_values_path(root, args.template))] if args.example else []
        values = collect_values(examples + args.values, args.set, args.set_str, args.set_file)
        text = render(root, args.template, values)
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
