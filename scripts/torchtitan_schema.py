"""List every key of a TorchTitan JobConfig with its default, read from its source (nothing is run).

    python scripts/torchtitan_schema.py path/to/torchtitan/config/job_config.py > tests/torchtitan_v0_2_2_keys.json
    python scripts/torchtitan_schema.py path/to/torchtitan/components/ft/config/job_config.py \
        > tests/torchtitan_v0_2_2_ft_keys.json   # the keys its fault-tolerance experiment adds

tests/test_config.py checks titanlite's schema against the committed list: every TorchTitan key
exists here, with TorchTitan's default unless the test names the reason it differs.
"""

import argparse
import ast
import json
import sys


def default_of(value: ast.expr, classes: dict):
    """The default a dataclass field declares: a literal, field(default_factory=list / lambda: [...]),
    or a nested section (field(default_factory=SomeClass))."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        factory = next(k.value for k in value.keywords if k.arg == "default_factory")
        if isinstance(factory, ast.Name) and factory.id in classes:
            return keys_of(classes[factory.id], classes)
        if isinstance(factory, ast.Name):
            return {"list": [], "dict": {}}[factory.id]
        return ast.literal_eval(factory.body)  # lambda: [...]
    return ast.literal_eval(value)


def keys_of(cls: ast.ClassDef, classes: dict) -> dict:
    return {
        node.target.id: default_of(node.value, classes)
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and node.value is not None
    }


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job_config", help="TorchTitan's torchtitan/config/job_config.py")
    args = parser.parse_args()
    with open(args.job_config) as f:
        module = ast.parse(f.read())
    classes = {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}
    json.dump(flatten(keys_of(classes["JobConfig"], classes)), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
