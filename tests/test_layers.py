"""The apps import only downward, and no module imports itself round a circle.

llmgw (the command, no Django) -> core (the kernel: refusals, the actor, the API and admin kits,
env parsing, bounded documents, outbound URLs, durations; no models) -> accounts -> catalog ->
fleet -> registry -> access (keys, teams, limits, usage) -> gateway (the data plane: the request
path only, no tables) -> signin (sign-in through the company's provider) -> console -> llmgw_site: a module may import its own app and the apps to its left, never one to its right,
not even inside a function. The README's Layout section draws the same map.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.imports import circles, import_graph, upward_imports

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {
    "llmgw": 0,
    "core": 1,
    "accounts": 2,
    "catalog": 3,
    "fleet": 4,
    "registry": 5,
    "access": 6,
    "gateway": 7,
    "signin": 8,
    "console": 9,
    "llmgw_site": 10,
}


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = import_graph(ROOT, LAYERS)
    assert len(graph) > 100  # the walk saw the project
    assert circles(graph) == []


def test_no_app_imports_a_higher_layer() -> None:
    assert [str(i) for i in upward_imports(import_graph(ROOT, LAYERS), LAYERS)] == []


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_it_finds_a_circle_made_of_imports_inside_functions(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/a.py": "def f():\n    from .b import g\n    return g\n",
            "low/b.py": "def g():\n    from low import c\n",
            "low/c.py": "import low.a\n",
            "low/d.py": "from . import a\n",  # imports into the circle, is not part of it
        },
    )
    assert circles(import_graph(tmp_path, ["low"])) == [["low.a", "low.b", "low.c"]]


def test_it_finds_a_lower_layer_importing_a_higher_one(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/models.py": "def later():\n    from high.views import page\n",
            "high/__init__.py": "",
            "high/views.py": "from low.models import later\npage = later\n",
        },
    )
    graph = import_graph(tmp_path, ["low", "high"])
    found = [str(i) for i in upward_imports(graph, {"low": 0, "high": 1})]
    assert found == ["low.models imports high.views, a higher layer"]
    assert circles(graph) == [["high.views", "low.models"]]


def test_the_kernel_has_no_models_and_no_app_below_it_but_the_command() -> None:
    """core/ is a package of rules, not a Django app: nothing in it owns a table."""
    assert not (ROOT / "core" / "models.py").exists()
    graph = import_graph(ROOT, LAYERS)
    core_imports = {
        target.split(".")[0]
        for module, targets in graph.items()
        if module.split(".")[0] == "core"
        for target in targets
    }
    assert core_imports <= {"core", "llmgw"}, core_imports


def test_the_data_plane_owns_no_tables_admin_or_migrations() -> None:
    """gateway/ is the request path: keys, teams and usage are access's, which it reads."""
    for name in ("models.py", "admin.py", "migrations", "api.py", "urls.py"):
        assert not (ROOT / "gateway" / name).exists(), name
