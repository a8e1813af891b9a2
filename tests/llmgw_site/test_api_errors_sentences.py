"""The API's refusal of a request that failed validation is one sentence, ended once."""

from __future__ import annotations

from rest_framework import exceptions, serializers

from llmgw_site.api_errors import exception_handler


def refused(detail: object) -> dict[str, object]:
    response = exception_handler(exceptions.ValidationError(detail), {})
    assert response is not None and response.status_code == 400
    return dict(response.data)


def test_it_ends_a_message_that_has_its_own_period_with_one_period() -> None:
    body = refused({"name": ["This field may not be blank."]})
    assert body == {
        "detail": "The request was refused, nothing was changed: name: This field may not be blank.",
        "code": "invalid",
        "problems": [{"field": "name", "message": "This field may not be blank."}],
    }


def test_it_joins_several_problems_with_semicolons_and_names_nested_fields() -> None:
    body = refused({"limits": {"rpm": ["must be 1 or more."]}, "non_field_errors": ["too late"]})
    assert body["detail"] == (
        "The request was refused, nothing was changed: limits.rpm: must be 1 or more; too late."
    )
    assert body["problems"] == [
        {"field": "limits.rpm", "message": "must be 1 or more."},
        {"field": "", "message": "too late"},
    ]


def test_it_says_how_many_more_problems_there_are_beyond_five() -> None:
    body = refused({f"field{n}": ["is wrong."] for n in range(7)})
    assert body["detail"] == (
        "The request was refused, nothing was changed: field0: is wrong; field1: is wrong; "
        "field2: is wrong; field3: is wrong; field4: is wrong (and 2 more)."
    )
    assert len(body["problems"]) == 7  # type: ignore[arg-type]


def test_a_serializers_own_refusal_reads_as_one_sentence() -> None:
    class Team(serializers.Serializer):
        name = serializers.CharField()

    team = Team(data={"name": ""})
    assert not team.is_valid()
    body = refused(team.errors)
    assert body["detail"] == (
        "The request was refused, nothing was changed: name: This field may not be blank."
    )


def test_a_last_problem_that_asks_ends_the_sentence_with_its_question_mark() -> None:
    body = refused({"min_replica": ["is not a field; did you mean 'min_replicas'?"]})
    assert body["detail"] == (
        "The request was refused, nothing was changed: min_replica: is not a field; did you "
        "mean 'min_replicas'?"
    )
