"""conftest.refused, the check every one-sentence refusal goes through, refuses what is not one."""

from subprocess import CompletedProcess

import pytest
from conftest import refused


def stderr(code: int, text: str) -> CompletedProcess:
    return CompletedProcess([], code, "", text)


def test_one_sentence_passes_with_its_fragments():
    assert refused(stderr(2, "error: x.yaml is not y (e.g. z).\n"), "x.yaml", "not y") == "error: x.yaml is not y (e.g. z)."
    refused(stderr(2, "error: is it the recipe?\n"), end="?")
    refused(stderr(2, "a rank's log line\nerror: x is not y.\n"), "not y", alone=False)


@pytest.mark.parametrize(
    "done, fragments, kwargs",
    [
        (stderr(1, "error: x is not y.\n"), [], {}),  # exit code 1
        (stderr(2, "error: x is not y.\n"), ["not z"], {}),  # a fragment missing
        (stderr(2, "error: x is not y. Try z.\n"), [], {}),  # two sentences
        (stderr(2, "error: x is not y! Try z.\n"), [], {}),
        (stderr(2, "error: x is not y\n"), [], {}),  # no full stop
        (stderr(2, "error: x is not y?\n"), [], {}),  # a question where a statement was expected
        (stderr(2, "error: x is not y.\nerror: nor z.\n"), [], {"alone": False}),  # two error lines
        (stderr(2, "Traceback (most recent call last):\nerror: x is not y.\n"), [], {"alone": False}),
        (stderr(2, "a log line\nerror: x is not y.\n"), [], {}),  # not alone
        (stderr(2, "x is not y.\n"), [], {"alone": False}),  # no error line
    ],
)
def test_anything_else_fails(done, fragments, kwargs):
    with pytest.raises(AssertionError):
        refused(done, *fragments, **kwargs)
