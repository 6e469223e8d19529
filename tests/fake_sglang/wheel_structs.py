"""SGLang's request structs and modules, read from its wheel (for tests/test_sglang_contract.py).

`read_structs` parses `io_struct.py` with `ast` (nothing of it is imported or run): each class
(dataclass in 0.5.6, msgspec.Struct in 0.5.23) becomes its fields, inherited ones included,
with their annotations. `violations` checks a JSON body against one: an unknown field (SGLang
drops or refuses it), a missing required one, a value its annotation does not admit.
`load_module` runs a self-contained module of the wheel (SamplingParams, the JSON contract
gate) with its `sglang.*` imports stubbed, so the checks are SGLang's own code.
"""

from __future__ import annotations

import ast
import types
import warnings
import zipfile
from dataclasses import dataclass

_SCALARS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


@dataclass(frozen=True)
class Struct:
    name: str
    fields: dict[str, tuple[ast.expr | None, bool]]  # name -> (annotation, required)


def read_structs(source: str) -> dict[str, Struct]:
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out: dict[str, Struct] = {}

    def fields_of(cls: ast.ClassDef) -> dict:
        fields: dict = {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                fields.update(fields_of(classes[base.id]))
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if "ClassVar" in ast.unparse(node.annotation):
                    continue
                required = node.value is None
                if isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "field":
                    kws = {k.arg for k in node.value.keywords}
                    required = not kws & {"default", "default_factory"}
                fields[node.target.id] = (node.annotation, required)
        return fields

    for name, cls in classes.items():
        out[name] = Struct(name, fields_of(cls))
    return out


def admits(ann: ast.expr | None, value: object) -> bool:
    """Whether a JSON value fits a typing annotation (unknown names admit anything)."""
    if ann is None:
        return True
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):  # a string annotation
        return admits(ast.parse(ann.value, mode="eval").body, value)
    if isinstance(ann, ast.Constant) and ann.value is None:
        return value is None
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return admits(ann.left, value) or admits(ann.right, value)
    if isinstance(ann, ast.Name):
        if ann.id in _SCALARS:
            ok = isinstance(value, _SCALARS[ann.id])
            return ok and (ann.id == "bool" or not isinstance(value, bool))
        return True  # a type alias or class of the module: not judged here
    if isinstance(ann, ast.Subscript):
        head = ast.unparse(ann.value).split(".")[-1]
        args = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        if head == "Optional":
            return value is None or admits(args[0], value)
        if head == "Union":
            return any(admits(a, value) for a in args)
        if head in ("List", "list", "Set", "set", "Sequence"):
            return isinstance(value, list) and all(admits(args[0], v) for v in value)
        if head in ("Dict", "dict"):
            return isinstance(value, dict)
        if head == "Literal":
            return value in [ast.literal_eval(a) for a in args]
    return True


def violations(struct: Struct, body: dict) -> list[str]:
    out = [f"{struct.name} has no field {k!r}" for k in body if k not in struct.fields]
    for key, (ann, required) in struct.fields.items():
        if key not in body:
            out += [f"{struct.name} requires {key!r}"] if required else []
        elif not admits(ann, body[key]):
            out.append(f"{key}={body[key]!r} does not fit {ast.unparse(ann)}")
    return out


def load_module(whl: zipfile.ZipFile, path: str) -> types.ModuleType:
    """Run `path` of the wheel as a module; its `from sglang... import X` get stand-ins
    (an identity function for `normalize*`, `object` otherwise)."""
    tree = ast.parse(whl.read(path).decode())
    stubs: dict[str, object] = {}
    kept = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            for alias in node.names:
                name = alias.asname or alias.name
                stubs[name] = (lambda x, *a, **k: x) if name.startswith("normalize") else object
            continue
        kept.append(node)
    tree.body = kept
    module = types.ModuleType(path.replace("/", ".").removesuffix(".py"))
    module.__dict__.update(stubs)
    with warnings.catch_warnings():  # its own imports' deprecations are not ours to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(compile(tree, f"{whl.filename}:{path}", "exec"), module.__dict__)  # SGLang's code
    return module
