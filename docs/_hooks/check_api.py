"""mkdocs hook: every public name (daeadjoint.__all__) has an API entry, and every API
entry is public.

The API pages under docs/api/ hold one `::: daeadjoint.NAME` line per name; adding a
name to `__all__` without that line (or leaving a line for a removed name) fails the
build. `__all__` is read from the source (ast), so the check does not import jax.
"""

import ast
import pathlib
import re

from mkdocs.exceptions import PluginError

_ENTRY = re.compile(r"^:::\s*daeadjoint\.([A-Za-z_][A-Za-z0-9_]*)\s*$", re.MULTILINE)


def _public_names(init_py: pathlib.Path) -> list[str]:
    tree = ast.parse(init_py.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise PluginError(f"{init_py} has no literal __all__")


def on_config(config):
    docs = pathlib.Path(config["docs_dir"])
    root = pathlib.Path(config["config_file_path"]).parent
    public = _public_names(root / "daeadjoint" / "__init__.py")
    documented: dict[str, str] = {}
    for page in sorted((docs / "api").glob("*.md")):
        for name in _ENTRY.findall(page.read_text()):
            if name in documented:
                raise PluginError(f"daeadjoint.{name} is documented twice "
                                  f"({documented[name]} and {page.name})")
            documented[name] = page.name
    missing = [n for n in public if n not in documented]
    extra = [n for n in documented if n not in public]
    if missing or extra:
        raise PluginError(
            "docs/api/*.md out of date with daeadjoint.__all__: "
            + (f"add a '::: daeadjoint.NAME' line for {missing}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"remove {extra} (not in __all__)" if extra else ""))
    return config
