"""A model's derived facts, asked in Python (Model methods) and in SQL (the Q forms the console's
filters use): both must say the same of every replica range."""

from __future__ import annotations

import pytest

from catalog.models import ON_DEMAND, PARKED, Model, is_on_demand, is_parked

pytestmark = pytest.mark.django_db

RANGES = [(0, None), (0, 0), (0, 1), (0, 5), (1, None), (1, 1), (2, 4), (3, None)]


def test_the_sql_and_python_forms_of_on_demand_and_parked_agree() -> None:
    for index, (low, high) in enumerate(RANGES):
        Model.objects.create(
            name=f"m{index}",
            source="http://127.0.0.1:9/m.gguf",
            min_replicas=low,
            max_replicas=high,
        )
    on_demand = set(Model.objects.filter(ON_DEMAND).values_list("name", flat=True))
    parked = set(Model.objects.filter(PARKED).values_list("name", flat=True))
    for index, (low, high) in enumerate(RANGES):
        name = f"m{index}"
        assert (name in on_demand) == is_on_demand(low, high), (low, high)
        assert (name in parked) == is_parked(low, high), (low, high)
    # Both kinds occur, so neither side can pass by saying no to everything.
    assert on_demand and parked
